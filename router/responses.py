"""OpenAI's Responses API (`POST /v1/responses`) over the chat path, its request side: a request
becomes a chat request (instructions as the system message, then the input messages) and runs as
one; its one choice comes back as router.response_reply makes it, a response object or the
Responses stream's typed events. `include: ["message.output_text.logprobs"]` (with
`top_logprobs`) asks the chat path for logprobs.

Input items given back (router.response_reply makes them): an earlier reply's `reasoning` item is
accepted and left out of the prompt; `function_call` and `function_call_output` items become the
assistant's tool_calls and the tool turns of the chat (function tools run as chat's tools,
router.tools).

A response is stored (router.response_store) unless the request says `store: false` or the
store is off: `previous_response_id` then continues its conversation (its input and output items
come before the new input; its instructions do not carry over, as OpenAI's do not), and it can
be fetched, listed (its input items) and deleted. `background: true` answers at once with the
response queued, and runs it here (router.background). A stored conversation (`conversation`) is
a 400, as are fields for features this server lacks (built-in tools, reasoning summaries),
rather than a reply that looks fine without them; `reasoning.effort` is the chat template's
`reasoning_effort`, as in chat.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator

from router.errors import bad_request, from_validation_error
from router.protocol import (REQUEST_ID_PATTERN, ChatCompletionRequest, ModelName, _Model, _schema_size_ok,
                             nulls_dropped, object_parameters)


RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the reply's logprobs
# OpenAI's other includables: outputs of built-in tools (which this server refuses) and encrypted
# reasoning (there is none here; reasoning items given back are left out of the prompt anyway)
_INCLUDABLE = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                      "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                      "computer_call_output.output.image_url", "code_interpreter_call.outputs"]


class InputText(_Model):
    type: Literal["input_text", "output_text", "refusal"]  # a user's text, an earlier reply's, its refusal
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class InputMessage(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def to_chat(self) -> dict:
        """As a chat message, whose text parts the chat path joins (router.protocol.ChatMessage)."""
        content = self.content if isinstance(self.content, str) else [
            {"type": "text", "text": part.value()} for part in self.content]
        return {"role": self.role, "content": content}


class _CallItem(_Model):
    """An input item about one function call, named by its call_id."""
    call_id: str = Field(min_length=1)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_CallItem):
    """A call the model made in an earlier reply, given back as input."""
    type: Literal["function_call"]
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_CallItem):
    """The result of a call, for the model to read."""
    type: Literal["function_call_output"]
    output: str | list[InputText]  # text, or text parts (joined for the model)

    def text(self) -> str:
        """Parts joined by newlines, as chat joins a tool message's parts (and vLLM both)."""
        return self.output if isinstance(self.output, str) else "\n".join(part.value() for part in self.output)


class ReasoningItem(_Model):
    """An earlier reply's reasoning given back as input (as clients replay output items): the
    reasoning of the assistant turn after it, as vLLM gives it to the template (which shows it or
    not: Qwen3's shows the turns' since the last user message)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    status: str | None = None

    def text(self) -> str:
        """Its reasoning text (its summary's where it gives none)."""
        parts = self.content if self.content else self.summary
        return "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str))


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)  # any text, as vLLM takes it
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict | None, info):
        return object_parameters(parameters, info.data.get("name"))

    def to_chat(self) -> dict:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class FunctionChoice(_Model):
    type: Literal["function"]
    name: str


_ITEM_TYPES = {"message": InputMessage, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _item_type(item) -> str | None:
    """The member an input item is, by its type (a message may leave it out): its errors are that
    member's alone, named by class (router.errors drops the tag from the field path)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    return cls.__name__ if cls else None


# Tagged by class name: router.errors drops a capitalised tag from the field path it reports
InputItem = Annotated[
    Annotated[InputMessage, Tag("InputMessage")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")] | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_type, custom_error_type="invalid_value",
                  custom_error_message=f"an input item's type must be one of {', '.join(_ITEM_TYPES)}")]
_ITEMS = TypeAdapter(list[InputItem])


def parse_items(items: list[dict]) -> list[InputItem]:
    """Stored item dicts (input items, or output items given back) as input items."""
    return _ITEMS.validate_python(items)


def item_dicts(items: str | list[InputItem]) -> list[dict]:
    """A request's input as Responses items with ids (a string is one user message), as
    `GET /v1/responses/{id}/input_items` lists them and a follow-up reads them back."""
    if isinstance(items, str):
        items = [InputMessage(role="user", content=items)]
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        if isinstance(item, InputMessage):
            parts = [InputText(type="input_text", text=item.content)] if isinstance(item.content, str) else item.content
            d.update(content=[p.model_dump() for p in parts], status="completed")
        d["id"] = d.get("id") or new_id({InputMessage: "msg", ReasoningItem: "rs"}.get(type(item), "fc"))
        out.append(d)
    return out


def chat_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat messages: consecutive function calls become one assistant turn's
    tool_calls (joining the assistant's message just before them), each output a tool turn."""
    out: list[dict] = []
    reasoning: str | None = None  # a reasoning item's, for the assistant turn that follows it
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
            continue
        if isinstance(item, InputMessage):
            out.append(item.to_chat())
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1].setdefault("reasoning", reasoning)
        reasoning = None  # only the turn right after it
    return out


def _check_outputs_answer_calls(items: list[InputItem]) -> None:
    """A function_call_output must answer a call made before it in the conversation (as OpenAI
    requires): a tool turn answering no call would reach the model as a dangling message."""
    calls = set()
    for item in items:
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise bad_request(f"No tool call found for function call output with call_id {item.call_id}.", "input")


class TextFormat(_Model):
    """`text.format`: Responses' form of chat's response_format, with json_schema's fields inline."""
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _size(self):
        if self.type == "json_schema" and self.schema_ is None:  # OpenAI's rule: never an unconstrained reply
            raise ValueError("text.format of type json_schema needs its schema in text.format.schema (Responses "
                             "puts json_schema's fields in text.format itself)")
        _schema_size_ok(self.schema_, "text.format.schema")
        return self

    def echoed(self) -> dict:
        """As the response object gives it back: a json_schema format's fields, the others' type alone."""
        if self.type != "json_schema":
            return {"type": self.type}
        return self.model_dump(by_alias=True, exclude_none=True)

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(_Model):
    format: TextFormat | None = None


# sent as null: their defaults (OpenAI types them "boolean or null", vLLM Optional)
_NULL_MEANS_DEFAULT = frozenset({"stream", "store", "parallel_tool_calls", "background", "truncation", "priority"})
# vLLM's extra fields of a Responses request that its chat request has too: passed on as given,
# and validated (and honoured, or refused) there
_CHAT_EXTRAS = ("stop", "seed", "top_k", "min_p", "repetition_penalty", "logit_bias", "ignore_eos",
                "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "cache_salt",
                "mm_processor_kwargs", "vllm_xargs")


class ResponsesRequest(_Model):
    model: ModelName = None
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None  # the system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)  # no upper bound (vLLM now refuses > 2)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    store: bool = True  # OpenAI's default; false, or the store off: the reply says store: false
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0  # vLLM's extra, as in chat
    # vLLM's extra: the response's id, as given (a path segment: no "/", not "." or "..")
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    # vLLM's extras that chat has too (_CHAT_EXTRAS): typed and checked by the chat request
    stop: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    structured_outputs: Any = None
    cache_salt: Any = None
    mm_processor_kwargs: Any = None
    vllm_xargs: Any = None
    # vLLM's extras for its harmony (gpt-oss) models, not implemented here: a 400 when set
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None
    previous_response: dict[str, Any] | None = None
    # Defined by OpenAI, not implemented here: a 400 when set.
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[_INCLUDABLE] | None = None  # OUTPUT_LOGPROBS: the reply's logprobs; the others have none here
    reasoning: dict[str, Any] | None = None
    background: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with include OUTPUT_LOGPROBS (OpenAI's range)
    truncation: Literal["auto", "disabled"] = "disabled"

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return nulls_dropped(data, _NULL_MEANS_DEFAULT)

    @field_validator("request_id")
    @classmethod
    def _a_path_segment(cls, request_id):
        """GET /v1/responses/{id} must find it: the path would read a "/" as two segments."""
        if request_id is not None and ("/" in request_id or request_id in (".", "..")):
            raise ValueError("a response's request_id may not contain '/' or be '.' or '..'")
        return request_id

    @field_validator("input", mode="before")
    @classmethod
    def _no_references(cls, items):
        """An `item_reference` names an item OpenAI stored; a 400 that says so, not a type error."""
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if isinstance(item, dict) and item.get("type") == "item_reference":
                raise ValueError(f"item_reference input items are not supported (item {i}): give the items "
                                 "themselves, or previous_response_id")
        return items

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _a_function_choice(cls, choice):
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            raise ValueError(f"tool_choice {choice.get('type')!r} is not supported: only none, auto, required "
                             "or a function (list only the tools to allow in `tools`)")
        return choice

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, tools):
        """OpenAI's built-in tools (web search, file search, ...) run on its side, not here."""
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                raise ValueError(f"only function tools are supported here, not {kind!r} (tool {i})")
        return tools

    @model_validator(mode="after")
    def _check_unsupported(self):
        for name, why in (("conversation", "this server stores no conversations (use previous_response_id)"),
                          ("prompt", "this server stores no prompt templates"),
                          ("enable_response_messages", "a reply's messages are its output items"),
                          ("previous_input_messages", "give the items as input, or previous_response_id"),
                          ("previous_response", "give previous_response_id (store true)")):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported in /v1/responses: {why}")
        if self.background and not self.store:  # vLLM's words
            raise ValueError("background can only be used when `store` is true")
        if self.structured_outputs is not None and self.text is not None and self.text.format is not None \
                and self.text.format.type != "text":
            raise ValueError("structured_outputs cannot be combined with text.format: give one of them")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not (isinstance(effort, str) and 0 < len(effort) <= 64):
            raise ValueError("reasoning: its effort must be a string of 1 to 64 characters")
        # a summary of "auto" leaves the kind to the server, and here it is none: the reasoning comes whole
        if self.reasoning and any(v not in (None, "auto") if k in ("summary", "generate_summary") else v is not None
                                  for k, v in self.reasoning.items() if k != "effort"):
            raise ValueError("reasoning: only its effort, and a summary of \"auto\", are supported in /v1/responses "
                             "(no summaries are made here: --reasoning-parser returns a thinking model's reasoning "
                             "whole, as reasoning_text)")
        return self

    @property
    def logprobs_asked(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def chat_request(self, history: list[InputItem] = ()) -> ChatCompletionRequest:
        """The same request on the chat path (400 for what the chat path refuses); `history`: the
        items of the conversation before this input (previous_response_id's)."""
        _check_outputs_answer_calls([*history, *([] if isinstance(self.input, str) else self.input)])
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += chat_messages(list(history))
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += chat_messages(self.input)
        if not messages:  # reasoning items alone become no message
            raise bad_request("input: no message to answer (reasoning items alone are not a conversation)",
                              param="input")
        body = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
                "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority}
        body.update({name: value for name in _CHAT_EXTRAS if (value := getattr(self, name)) is not None})
        if self.logprobs_asked:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.truncation == "auto":  # vLLM's: the input's start dropped to leave room for max_output_tokens
            body["truncate_prompt_tokens"] = -1
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # a rule of the chat path's; most name fields both requests have
            raise from_validation_error(e, set(type(self).model_fields)) from None


# The chat request's fields that this request names otherwise, for the errors about them.
_CHAT_FIELDS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "reasoning_effort": "reasoning.effort"}


def responses_field(chat_field: str) -> str:
    if chat_field.startswith("tools.") and ".function." in chat_field:  # Responses' tools hold no `function`
        return chat_field.replace(".function.", ".", 1)
    return _CHAT_FIELDS.get(chat_field, chat_field)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
