"""Tool calling in /v1/chat/completions: which constraint a `tool_choice` puts on the output, and
how tools and earlier tool turns are rendered into the prompt.

    tool_choice  none       the output is content; a template that renders tools is given them
                            (vLLM's), unless --exclude-tools-when-tool-choice-none
                 auto       tools in the prompt; calls in the output, written in the format of
                            --tool-call-parser (below), become tool_calls, the rest stays content
                 required   the output is constrained to one or more such calls (one without
                            parallel_tool_calls), each of a listed tool with arguments that
                            match its parameters' schema
                 {function} the output is constrained to that function's arguments

Calls are written in the format of `--tool-call-parser` (FORMATS), the Hermes way by default:

    hermes       <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}   (several: `; ` between)
    mistral      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
                 (v11 tokenizers: [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"})
    pythonic     [get_weather(city="Paris"), now()]                       (llama4_pythonic too)

Under `required` the output is held to calls by a grammar over each tool's JSON schema, so a
format whose arguments are not JSON (pythonic) is held to llama3_json's calls there, as vLLM
holds every parser's required output to JSON.

A template that knows tools (it reads `tools`) renders them, the assistant's `tool_calls` and
the `tool` turns itself; for one that does not, the tools go into the system prompt with the
format's instructions, calls into the assistant turn as the format writes them, and results
into the format's response blocks.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from engine.structured.compiler import JSON_DEFAULTS
from engine.structured.params import StructuredOutputsParams
from engine.structured.schemas import closed_objects, enforceable
from router import mistral_tool_parser, pythonic_tool_parser
from router.llama3_tool_parser import Llama3JsonStream
from router.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolDefinition
from router.tool_calls import CallStream, NamedCallStream, call, parse_whole
from router.tool_parser import ToolCallStream

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_PROMPT = """You can call functions to help with the user's request. The functions are described \
in JSON inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, answer with a JSON object holding its name and arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""

LLAMA3_TOOLS_PROMPT = """You can call functions to help with the user's request. The functions are \
described in JSON below:
{tools}
To call a function, answer with only a JSON object holding its name and arguments, \
{{"name": <function name>, "parameters": <arguments as a JSON object>}}; to call several, \
separate the objects with ";"."""

MISTRAL_TOOLS_PROMPT = """You can call functions to help with the user's request. The functions are \
described in JSON below:
{tools}
To call functions, answer with only [TOOL_CALLS] and a JSON list of calls, \
[TOOL_CALLS][{{"name": <function name>, "arguments": <arguments as a JSON object>}}, ...]."""

PYTHONIC_TOOLS_PROMPT = """You can call functions to help with the user's request. The functions are \
described in JSON below:
{tools}
To call functions, answer with only a Python list of calls with keyword arguments, \
[func_name1(param1=value1, param2=value2), func_name2(param=value)], and no other text."""


@dataclass(frozen=True)
class ToolFormat:
    """How calls are written under one `--tool-call-parser`: what parses them, the instructions for
    a template that does not know tools, and the text of a call (in history, and in required
    mode's grammar: `open` + `{"name": ..., key: arguments}` + `close`, calls separated by `separator`)."""
    stream: type[CallStream]
    prompt: str
    key: str  # the arguments' key
    open: str
    close: str
    separator: str
    response: tuple[str, str]  # around a tool result, for a template that does not know tools
    required: str | None = None  # the format required mode's grammar writes instead (FORMATS' key)
    begin: str = ""  # around all of a reply's calls
    end: str = ""
    special_tokens: bool = False  # its calls open with a special token: the text keeps them

    def call_text(self, name: str, arguments: str) -> str:
        body = json.dumps({"name": name, self.key: _arguments(arguments)}, ensure_ascii=False)
        return f"{self.open}{body}{self.close}"

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """An assistant turn's calls, (name, arguments JSON text) each, as the model writes them."""
        return self.begin + self.separator.join(self.call_text(*c) for c in calls) + self.end

    def history_id(self, call_id: str) -> str:
        """A call's id as a template that renders tools is given it."""
        return call_id


class MistralFormat(ToolFormat):
    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return mistral_tool_parser.TAG + super().calls_text(calls)

    def history_id(self, call_id: str) -> str:
        return call_id[-9:]  # Mistral's templates take 9-character ids only (vLLM cuts them so too)


class PythonicFormat(ToolFormat):
    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return "[" + ", ".join(pythonic_tool_parser.call_text(name, _object_arguments(arguments))
                               for name, arguments in calls) + "]"


FORMATS = {
    "hermes": ToolFormat(ToolCallStream, TOOLS_PROMPT, "arguments", "<tool_call>\n", "\n</tool_call>", "\n",
                         ("<tool_response>\n", "\n</tool_response>")),
    "llama3_json": ToolFormat(Llama3JsonStream, LLAMA3_TOOLS_PROMPT, "parameters", "", "", "; ", ("", "")),
    "mistral": MistralFormat(mistral_tool_parser.MistralStream, MISTRAL_TOOLS_PROMPT, "arguments", "", "", ", ",
                             ("", ""), begin="[", end="]", special_tokens=True),
    "pythonic": PythonicFormat(pythonic_tool_parser.PythonicStream, PYTHONIC_TOOLS_PROMPT, "", "", "", "", ("", ""),
                               required="llama3_json"),
}
FORMATS["llama4_pythonic"] = FORMATS["pythonic"]  # vLLM's name for Llama 4's (<|python_start|> is taken by both)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[ToolDefinition, ...] = ()
    function: str | None = None  # mode "named": the function called
    parallel: bool = True
    parser: str = "hermes"  # FORMATS' key: how calls are written

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: str = "hermes", exclude_when_none: bool = False) -> "ToolPlan":
        """`exclude_when_none`: vLLM's --exclude-tools-when-tool-choice-none; without it tool_choice
        "none" still shows the model its tools (as vLLM and OpenAI do), and no call is parsed."""
        tools = tuple(req.tools or ())
        choice = req.tool_choice
        if not tools or choice == "none":
            return cls("none", () if exclude_when_none else tools, parser=parser)
        if isinstance(choice, NamedToolChoice):
            return cls("named", tools, choice.function.name, req.parallel_tool_calls, parser)
        return cls(choice or "auto", tools, None, req.parallel_tool_calls, parser)

    @property
    def format(self) -> ToolFormat:
        fmt = FORMATS[self.parser]
        return FORMATS[fmt.required] if self.mode == "required" and fmt.required else fmt

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def apply(self, choice: dict) -> None:
        """A finished reply's choice: its text -> content and message.tool_calls."""
        message = choice["message"]
        if self.mode == "named":
            content, calls = None, [call(self.function, message["content"] or "")]  # cut before any argument
        else:
            stream = self.stream()
            content, calls = parse_whole(stream, message["content"] or "", stream.cut_by(choice["finish_reason"]))
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
            if choice["finish_reason"] == "stop" and self.mode != "named":  # a forced call ends "stop" (OpenAI's)
                choice["finish_reason"] = "tool_calls"

    def stream(self) -> CallStream:
        if self.mode == "named":
            return NamedCallStream(self.function)
        stream = self.format.stream(self.max_calls, self.accepts)
        stream.calls_only = self.mode == "required"  # its grammar allows no content: a cut "<" starts a call
        return stream

    def accepts(self, name: str, arguments: str) -> bool:
        """Whether a parsed block calls one of the tools, with arguments that match its schema
        when it is strict (required mode's grammar ensures both; auto mode's output is free)."""
        tool = next((t for t in self.tools if t.function.name == name), None)
        if tool is None:
            return False
        if not tool.function.strict:
            return True
        try:
            return _validator(json.dumps(_arguments_schema(tool))).is_valid(json.loads(arguments))
        except Exception:  # a schema jsonschema cannot apply (llguidance compiled it): not held against the call
            return True

    def spec(self) -> StructuredOutputsParams | None:
        """The constraint on the output: required and named calls are enforced."""
        if self.mode == "named":
            return _arguments_spec(next(t for t in self.tools if t.function.name == self.function))
        if self.mode == "required":
            return StructuredOutputsParams(grammar=required_grammar(self.tools, self.parallel, self.format))
        return None

    def tool_specs(self) -> list[tuple[StructuredOutputsParams, str]]:
        """Each offered tool's arguments schema as a constraint, with the field that holds it: all
        must compile (a strict tool's strictly), whatever the mode, so that a bad schema is a 400
        naming its tool rather than one that passes in auto mode and fails in required."""
        if not self.calls_tools:
            return []
        return [(_arguments_spec(t), f"tools.{i}.function.parameters") for i, t in enumerate(self.tools)]


def _arguments_spec(tool: ToolDefinition) -> StructuredOutputsParams:
    # Not strict: JSON schema keywords llguidance lacks are ignored (as OpenAI's non-strict mode
    # does not enforce the schema at all), not refused.
    return StructuredOutputsParams(json=_arguments_schema(tool), lenient=not tool.function.strict)


@functools.lru_cache(maxsize=256)
def _validator(schema: str):
    """A validator for a strict tool's arguments that runs none of the schema's regular expressions
    (`pattern`, `patternProperties`, `format: regex`, wherever a `$ref` leads): it runs on the
    ingress's event loop, on text a client can steer, and Python's `re` backtracks (`^(a+)+$`
    against 40 a's and a "!": hours). Structure, types, ranges and enums are still checked."""
    import jsonschema

    base = jsonschema.validators.validator_for(json.loads(schema))
    extra_keys = base.VALIDATORS["additionalProperties"]

    def additional(validator, allowed, instance, node):
        if "patternProperties" not in node:  # which keys are extra would be a regex question
            yield from extra_keys(validator, allowed, instance, node)

    cls = jsonschema.validators.extend(base, {"pattern": _unchecked, "patternProperties": _unchecked,
                                              "additionalProperties": additional,
                                              "unevaluatedProperties": _unchecked})
    formats = jsonschema.FormatChecker([f for f in base.FORMAT_CHECKER.checkers if f != "regex"])
    return cls(json.loads(schema), format_checker=formats)


def _unchecked(validator, value, instance, node):
    return None


def _arguments_schema(tool: ToolDefinition) -> dict:
    """The schema a call's arguments meet: always an object (`parameters: {}`, which MCP servers
    send for a tool without arguments, or a schema that gives no type, is any object)."""
    schema = tool.function.parameters
    if schema is None:
        return NO_ARGUMENTS
    return schema if schema.get("type") == "object" else {**schema, "type": "object"}  # ["object", "null"] too


def required_grammar(tools: tuple[ToolDefinition, ...], parallel: bool, fmt: ToolFormat = FORMATS["hermes"]) -> str:
    """A Lark grammar (llguidance's dialect, with %json) for one or more calls in `fmt`'s way.
    Each tool's arguments keep their own schema as a JSON root, so its $refs still resolve."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        schema = closed_objects(enforceable(_arguments_schema(tool)))
        schema.setdefault("x-guidance", {**JSON_DEFAULTS, "lenient": not tool.function.strict})
        # the name as the prompt shows it (a non-ASCII one raw, not as \u escapes)
        head = json.dumps(f'{{"name": {json.dumps(tool.function.name, ensure_ascii=False)}, {json.dumps(fmt.key)}: ',
                          ensure_ascii=False)
        rules.append(f"call_{i}: {head} args_{i} \"}}\"\nargs_{i}: %json {json.dumps(schema)}")
        names.append(f"call_{i}")
    calls = f"call ({json.dumps(fmt.separator)} call)*" if parallel else "call"
    start = "start: " + " ".join(t for t in (json.dumps(fmt.begin) if fmt.begin else "", calls,
                                             json.dumps(fmt.end) if fmt.end else "") if t)
    call_rule = " ".join(t for t in (json.dumps(fmt.open) if fmt.open else "", "(" + " | ".join(names) + ")",
                                     json.dumps(fmt.close) if fmt.close else "") if t)
    return "\n".join([start, f"call: {call_rule}", *rules])


# -- the prompt ------------------------------------------------------------------------------------

def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _arguments(text: str):
    """A call's arguments as templates want them: parsed JSON (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nested past Python's stack: a string skips the body's depth limit
        return text


def render(messages: list[ChatMessage], plan: ToolPlan, native: bool) -> tuple[list[dict], list[dict] | None]:
    """-> (messages for apply_chat_template, its `tools` argument). `native`: the template
    renders tools itself (template_knows_tools)."""
    tools = [t.model_dump(exclude_none=True) for t in plan.tools] or None
    if native:
        return [_native(m, plan.format) for m in messages], tools
    out = [_as_text(m, plan.format) for m in messages]
    if tools and plan.calls_tools:  # under "none" vLLM's template is given tools it does not show
        prompt = plan.format.prompt.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _object_arguments(text: str) -> dict:
    """A call's arguments for a template that renders tools itself: the object, or {} for text that
    is not a JSON object (a call cut short elsewhere), as vLLM gives it: templates that iterate over
    the arguments fail on anything else, and the client would resend that history every turn."""
    value = _arguments(text)
    return value if isinstance(value, dict) else {}


def _native(m: ChatMessage, fmt: ToolFormat) -> dict:
    msg = m.to_template()
    if m.tool_calls:
        msg["tool_calls"] = [{"id": fmt.history_id(c.id), "type": "function",
                              "function": {"name": c.function.name, "arguments": _object_arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = fmt.history_id(m.tool_call_id)
    return msg


def _as_text(m: ChatMessage, fmt: ToolFormat) -> dict:
    msg = m.to_template()
    if m.tool_calls:
        blocks = fmt.calls_text([(c.function.name, c.function.arguments) for c in m.tool_calls])
        msg["content"] = f"{msg['content']}\n{blocks}" if msg["content"] else blocks
    if m.role == "tool":
        msg["content"] = f"{fmt.response[0]}{msg['content']}{fmt.response[1]}"
    return msg
