"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Only the router parses untrusted input, and it does so here: types and ranges are checked by
pydantic, cross-field rules in `model_validator`s, and everything we accept but cannot honour is
rejected with a 400 naming the field rather than silently ignored. Unknown fields are ignored, as
vLLM does, so that clients sending newer OpenAI fields keep working.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.sampling_params import MAX_LOGIT_BIAS, RequestOutputKind, SamplingParams
from engine.beam_search import MAX_BEAM_WIDTH, BeamSearch

MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES; the server's --max-sequences-per-request (256) bounds prompts x n
REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,256}$"  # printable ASCII, no spaces: it goes into ids and log lines

NonEmptyStr = Annotated[str, Field(min_length=1)]
# a request's model: None (or "", as vLLM reads it) is the served model
ModelName = Annotated[str | None, BeforeValidator(lambda v: None if v == "" else v)]
TokenId = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extra: with include_usage, every chunk carries the usage so far


_NULL_MEANS_DEFAULT = frozenset({"stream", "n", "logprobs", "presence_penalty", "frequency_penalty",
                                  "parallel_tool_calls", "echo", "return_tokens_as_token_ids"})


def nulls_dropped(data, fields: frozenset[str]):
    """A request body less `fields` sent as null: OpenAI's "boolean or null" / "number or null"
    fields (vLLM's Optional ones), so that a client that sends every field, unset ones as null,
    gets their defaults rather than a 400."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if not (v is None and k in fields)}
    return data


class _SamplingFields(_Model):
    """The fields completions and chat completions share, mapped onto engine.SamplingParams."""

    model: ModelName = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)  # None: 1.0, as OpenAI; no upper bound (vLLM now refuses > 2)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # any 64-bit seed, as vLLM; -1: none (vLLM's); the engine seeds sample i with seed + i (<= 2**63 - n)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (the openai client sends them with `extra_body`)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None  # OpenAI's for chat; vLLM takes it in completions too
    # keep the prompt's last k tokens (first k, truncation_side "right"); -1: what leaves room for max_tokens
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM extra: logprobs name tokens "token_id:{id}", not their text (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's structured-output fields before 0.12, which clients still send: folded into
    # structured_outputs, so that a constraint never falls away unnoticed (vLLM now ignores them)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # which compiler: this server has one, so it is ignored
    guided_whitespace_pattern: str | None = None
    bad_words: list[str] | None = None  # vLLM extra: words the output may not complete
    allowed_token_ids: list[TokenId] | None = None  # vLLM extra: the only tokens that may be sampled
    use_beam_search: bool = False  # vLLM extra: beam search of width n (engine.beam_search)
    cache_salt: str | None = Field(None, min_length=1)  # vLLM extra: share cached prefix blocks only with this salt
    return_token_ids: bool = False  # vLLM extra: prompt_token_ids and each choice's token_ids in the reply
    # vLLM extra: names the reply (`cmpl-{request_id}`); an X-Request-Id header comes first, as in vLLM
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    length_penalty: float | None = None  # vLLM extra, beam search's: a score is divided by length ** this
    priority: int = 0  # vLLM extra: lower runs first under --scheduling-policy priority; else only 0
    # vLLM extras this server does not implement: a 400 when set
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    logprob_token_ids: list[Any] | None = None
    repetition_detection: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return nulls_dropped(data, _NULL_MEANS_DEFAULT)

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:  # {}: none
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be positive, or -1 (as many as leave room for max_tokens)")
        _refuse(self, "logits_processors", "vllm_xargs", "mm_processor_kwargs", "logprob_token_ids",
                "repetition_detection")
        if self.thinking_token_budget not in (None, -1):  # -1 is vLLM's "no budget"; 0 asks something (none)
            raise ValueError("thinking_token_budget is not supported by this server")
        self._fold_guided()
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise ValueError("response_format cannot be combined with structured_outputs: give one of them")
        self._check_beam_search()
        return self

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the model's own logprobs: a field that would reshape the
        distribution, or stop a beam on text, is refused with it rather than ignored."""
        if not self.use_beam_search:
            if self.length_penalty not in (None, 1.0):
                raise ValueError("length_penalty applies to beam search only (use_beam_search true)")
            return
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search, got {self.n}")
        formatted = self.response_format is not None and self.response_format.type != "text"
        for name, unset in (("top_p", self.top_p in (None, 1.0)), ("top_k", self.top_k in (None, 0, -1)),
                            ("min_p", not self.min_p), ("presence_penalty", not self.presence_penalty),
                            ("frequency_penalty", not self.frequency_penalty),
                            ("repetition_penalty", self.repetition_penalty in (None, 1.0)),
                            ("logit_bias", not self.logit_bias), ("min_tokens", not self.min_tokens),
                            ("stop", not self.stop), ("bad_words", not self.bad_words),
                            ("allowed_token_ids", self.allowed_token_ids is None),
                            ("structured_outputs", self.structured_outputs is None),
                            ("response_format", not formatted)):
            if not unset:
                raise ValueError(f"{name} cannot be combined with use_beam_search")

    def beam_search(self) -> BeamSearch | None:
        """The request's beam search, when it asks for one."""
        if not self.use_beam_search:
            return None
        return BeamSearch(self.n, 1.0 if self.length_penalty is None else self.length_penalty,
                          self.include_stop_str_in_output)

    def _guided(self) -> dict[str, Any]:
        """The guided_* fields given, by their structured_outputs names."""
        return {k: v for k in ("json", "regex", "choice", "grammar") if (v := getattr(self, f"guided_{k}")) is not None}

    def _fold_guided(self) -> None:
        given = self._guided()
        if self.guided_whitespace_pattern is not None and "json" not in given:
            raise ValueError("guided_whitespace_pattern applies to guided_json")
        if not given:
            return
        names = self.structured_param
        if len(given) > 1 or self.structured_outputs is not None:
            raise ValueError(f"{names}{' and structured_outputs' if self.structured_outputs else ''}: "
                             "give one constraint on the output")
        if self.guided_whitespace_pattern is not None:
            given["whitespace_pattern"] = self.guided_whitespace_pattern
        try:
            self.structured_outputs = StructuredOutputs.model_validate(given)
        except ValidationError as e:
            raise ValueError(f"{names}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None

    @property
    def structured_param(self) -> str:
        """The field that set structured_outputs, for the errors about it."""
        return " and ".join(f"guided_{k}" for k in self._guided()) or "structured_outputs"

    @property
    def stream_usage(self) -> tuple[bool, bool]:
        """(a usage chunk before [DONE], the usage so far in every chunk)."""
        final = self.stream_options is not None and self.stream_options.include_usage
        return final, final and self.stream_options.continuous_usage_stats

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         defaults: Mapping[str, float | int]) -> SamplingParams:
        """Raises ValueError whose message starts with the offending field's name. `defaults`:
        the server's for the sampling fields left unset (RouterSettings.sampling_defaults; its
        max_tokens is applied once the prompt is known, OpenAIServing._start)."""
        def given(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
            min_p=given("min_p", 0.0), repetition_penalty=given("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, prompt_logprobs=prompt_logprobs,
            logit_bias=_clamped_bias(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, cache_salt=self.cache_salt,
            priority=self.priority,
            # a reply sent whole needs no output per token from the engine (nor one per token over Ray)
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


def check_sampling_values(values: dict) -> None:
    """ValueError naming the first of these sampling fields whose value no request could send."""
    try:
        _SamplingFields.model_validate(values)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        raise ValueError(f"{'.'.join(map(str, error['loc']))}: {error['msg']}, got {values}") from None


def _refuse(request: BaseModel, *names: str, where: str = "by this server") -> None:
    """A 400 naming the first of these fields that is set (not None, False or empty)."""
    for name in names:
        if getattr(request, name):
            raise ValueError(f"{name} is not supported {where}")


def _check_logit_bias(bias: dict[str, float]) -> None:
    """OpenAI's logit_bias: token id (a JSON key, so a string) -> bias, a number (clamped to
    [-100, 100] by _clamped_bias, as vLLM's server clamps it)."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    if not all(t.isascii() and t.isdigit() and len(t) <= 12 for t in bias):
        raise ValueError("logit_bias keys must be token ids (non-negative integers, as strings)")
    if not all(math.isfinite(b) for b in bias.values()):
        raise ValueError("logit_bias values must be finite numbers")


def _clamped_bias(bias: dict[str, float]) -> dict[int, float]:
    """Biases past OpenAI's [-100, 100] taken at its ends, as vLLM takes them."""
    return {int(t): min(100.0, max(-100.0, b)) for t, b in bias.items()}


PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=0)  # the OpenAI (and vLLM) default for completions; 0: see echo
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; the engine's max_logprobs bounds them
    echo: bool = False  # the prompt before the completion, with its logprobs when logprobs is set
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM extra: each choice's prompt_logprobs
    add_special_tokens: bool = True  # vLLM extra: a text prompt gets the tokenizer's BOS, where it has one

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens_is_16(cls, data):
        """max_tokens null is the default, 16, as vLLM takes it (not "as far as the model goes")."""
        return nulls_dropped(data, frozenset({"max_tokens"}))

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 is only allowed with echo or prompt_logprobs (the reply is the prompt)")
        _refuse(self, "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is only supported equal to n")
        if self.use_beam_search and self.max_tokens == 0:
            raise ValueError("max_tokens 0 cannot be combined with use_beam_search")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            return [""]
        return list(p)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top-k the engine computes per prompt token: enough for echo's logprobs and for
        prompt_logprobs; None when neither needs prompt logprobs."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None

    def sampling_params(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        # max_tokens 0 (vLLM, OpenAI): the reply is the prompt alone. The engine still draws one
        # token from the prefill's last row (no extra step), which the reply leaves out.
        max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, self.engine_prompt_logprobs, defaults or {})


# Limits on what a request may ask the grammar compiler to build (400 beyond them).
MAX_SCHEMA_CHARS = 64_000  # one JSON schema (a response_format's, a tool's parameters), serialized
MAX_REGEX_CHARS = 4_000
MAX_GRAMMAR_CHARS = 64_000
MAX_CHOICES = 1_000
MAX_TOOLS = 128  # OpenAI's own limit


def _schema_size_ok(schema: dict | str | None, what: str) -> None:
    text = schema if isinstance(schema, str) else json.dumps(schema or {})
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} is {len(text)} characters of JSON; at most {MAX_SCHEMA_CHARS} are allowed")


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` extra: exactly one constraint on the output."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = Field(None, max_length=MAX_REGEX_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None
    structural_tag: Any = None  # vLLM's, not implemented here: a 400 naming it
    # vLLM's options: the JSON's whitespace (a regex); the others ask what this server does anyway
    # (engine.structured.params)
    whitespace_pattern: str | None = Field(None, max_length=MAX_REGEX_CHARS)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by this server")
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object))
                 if v is not None and v is not False]  # {} (any JSON) and "" are given too
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object")
        if self.whitespace_pattern is not None and given[0] not in ("json", "json_object"):
            raise ValueError("structured_outputs.whitespace_pattern applies to json and json_object")
        if isinstance(self.json_, str):
            try:
                json.loads(self.json_)
            except ValueError:
                raise ValueError("structured_outputs.json is not valid JSON") from None
            except RecursionError:  # a string is not held to the body's depth limit
                raise ValueError("structured_outputs.json nests too deeply") from None
        _schema_size_ok(self.json_, "structured_outputs.json")
        return self


class JsonSchemaFormat(_Model):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # true: schema keywords the engine cannot enforce are a 400, not ignored

    @model_validator(mode="after")
    def _size(self):
        _schema_size_ok(self.schema_, "response_format.json_schema.schema")
        return self


def object_parameters(parameters: dict | None, name: str | None) -> dict | None:
    """OpenAI's refusal of a function whose arguments are not a JSON object (a client's **kwargs)."""
    kind = (parameters or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f"invalid schema for function {name!r}: schema must be a JSON Schema of "
                         f"'type: \"object\"', got 'type: {json.dumps(kind)}'")
    return parameters


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)  # any text, as vLLM takes it (OpenAI's own API allows [A-Za-z0-9_-]{1,64})
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    @model_validator(mode="after")
    def _size(self):
        _schema_size_ok(self.parameters, f"the parameters of tool {self.name}")
        return self

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict | None, info):
        return object_parameters(parameters, info.data.get("name"))


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# Content parts read as text, as vLLM reads them: chat's own, the Responses API's (clients that
# share one message list between the two), and an assistant's refusal (its `refusal` is its text).
TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")
MEDIA_PART_TYPES = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "input_file")


class TextPart(_Model):
    type: Literal[TEXT_PART_TYPES]
    text: str | None = None  # null: a part with nothing in it (skipped, as vLLM skips it)
    refusal: str | None = None

    def value(self) -> str | None:
        return self.refusal if self.type == "refusal" else self.text


class ChatMessage(_Model):
    # OpenAI's system, developer, user, assistant, tool, or any other the chat template knows
    # (Llama 3's ipython), as vLLM takes them; one the template rejects is its 400
    role: NonEmptyStr
    content: str | list[TextPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # An assistant turn's reasoning given back (vLLM takes either name): templates that show the
    # reasoning of the turns since the last user message (Qwen3's) need it to render them as made.
    reasoning: str | None = None
    reasoning_content: str | None = None
    function_call: Any = None  # OpenAI's deprecated form of tool_calls: a 400 (send tool_calls)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """A part this text-only server cannot read is refused saying so, not by a schema mismatch."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES:
                raise ValueError(f"{kind} content is not supported: this server serves a text-only model")
            if isinstance(part, dict) and kind not in TEXT_PART_TYPES:
                raise ValueError(f"unsupported content part type {kind!r} (supported: {', '.join(TEXT_PART_TYPES)})")
        return content

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value):
        if value is not None:
            raise ValueError("function_call is OpenAI's deprecated form of tool calls, not supported: send tool_calls")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as the template sees them)."""
        if isinstance(self.content, list):
            texts = (part if isinstance(part, str) else part.value() for part in self.content)
            return "\n".join(t for t in texts if t is not None)
        return self.content or ""

    def to_template(self) -> dict[str, Any]:
        msg = {"role": self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and thought is not None:
            msg["reasoning"] = msg["reasoning_content"] = thought
        return msg


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of the next one
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; the engine's max_logprobs bounds them
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM extra: end the prompt with the assistant header
    add_special_tokens: bool = False  # vLLM extra: the chat template writes the special tokens itself
    continue_final_message: bool = False  # vLLM extra: the reply goes on with the last message's text
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more variables for the chat template
    # OpenAI's function calling before tools, and vLLM extras not implemented: a 400 when set
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    chat_template: str | None = None  # a template of the request's own is code the server would run
    echo: bool = False  # vLLM extra: the reply begins with the last message's text when it has the reply's role
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM extra: the reply's prompt_logprobs
    documents: list[dict[str, Any]] | None = None  # vLLM extra: passed to the chat template (RAG templates)
    include_reasoning: bool = True  # vLLM extra: false leaves the reasoning (--reasoning-parser's) out of the reply
    # OpenAI's, for reasoning models: the chat template's variable (as vLLM passes it); a 400 where it reads none
    reasoning_effort: str | None = Field(None, min_length=1, max_length=64)
    # OpenAI's fields for what a text model served here cannot do: a 400 when set
    modalities: list[str] | None = None  # ["text"] is what every reply is
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.top_logprobs not in (None, 0) and not self.logprobs:  # 0, vLLM's default, asks nothing
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise ValueError(f"{'functions' if self.functions else 'function_call'} (OpenAI's deprecated function "
                             "calling) is not supported: send tools and tool_choice")
        _refuse(self, "chat_template", where="in chat completions")
        if any(m != "text" for m in self.modalities or ()):
            raise ValueError("modalities: this model's replies are text only")
        for name in ("audio", "prediction", "web_search_options"):  # an empty one asks for it too ({}: search)
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this server")
        if self.stream and self.prompt_logprobs not in (None, 0):  # vLLM's rule: the field is on the whole reply
            raise ValueError("prompt_logprobs is not available when stream is true")
        _check_template_options(self)
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        choice = self.tool_choice
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
        formatted = self.response_format is not None and self.response_format.type != "text"
        if forced and (formatted or self.structured_outputs is not None):
            raise ValueError("tool_choice required or a named function cannot be combined with response_format "
                             "or structured_outputs: each decides the output's form")
        if forced and self.use_beam_search:
            raise ValueError("tool_choice required or a named function cannot be combined with use_beam_search")

    def reply_role(self, response_role: str = "assistant") -> str:
        """The reply's role, as vLLM names it: `response_role` (the server's --response-role), or
        the last message's when the prompt does not open a new turn (add_generation_prompt false)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self, response_role: str = "assistant") -> str:
        """What `echo` puts before the reply: the last message's text when it has the reply's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role(response_role) else ""

    def sampling_params(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = None if self.stream else self.prompt_logprobs  # 0 streamed: nothing to send
        return self._sampling_params(max_tokens, logprobs, prompt_logprobs, defaults or {})


class TokenizeRequest(_Model):
    model: ModelName = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: as the endpoint does, True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)  # rendered as a chat request's are
    return_token_strs: bool = False  # vLLM's: the tokens as the tokenizer's vocabulary writes them too

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        _check_template_options(self)
        return self


# apply_chat_template's own arguments, which chat_template_kwargs may not set
# (tests/test_router_unit.py checks it against the installed transformers' signature)
TEMPLATE_ARGUMENTS = frozenset({"self", "conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def _check_template_options(request: ChatCompletionRequest | TokenizeRequest) -> None:
    if request.continue_final_message and request.add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt false: the reply goes on with the "
                         "last message instead of starting a new one")
    taken = sorted(TEMPLATE_ARGUMENTS & set(request.chat_template_kwargs or ()))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")


class DetokenizeRequest(_Model):
    model: ModelName = None
    tokens: list[TokenId]


class PoolingFields(_Model):
    """What the bodies of an embedding model's routes share (embeddings, score, rerank; vLLM's
    PoolingBasicRequestMixin)."""
    model: ModelName = None
    user: str | None = None
    # vLLM extras
    use_activation: bool | None = None  # L2-normalise (the pooler's default: yes)
    # keep the first k tokens (vLLM's pooling runner; the last k, truncation_side "left"); -1: max_model_len of them
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data):
        if isinstance(data, dict) and "normalize" in data:  # vLLM 0.32's rule and words
            raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
        return data


class InputPoolingFields(PoolingFields):
    """What the bodies that pool each of their inputs share (embeddings, pooling, classify):
    `input` (text, token ids, or a list of either), or vLLM's `messages` rendered by the chat
    template."""
    input: PromptInput | None = None
    messages: list[ChatMessage] | None = None
    # vLLM extras
    add_special_tokens: bool | None = None  # None: True for input, False for messages (the template writes them)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllms_forms(cls, data):
        if not isinstance(data, dict):
            return data
        given = data.get("input")
        if isinstance(given, list) and given and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                      for m in given):
            if "messages" in data:
                raise ValueError("give exactly one of input or messages")
            data = {**data, "messages": given}  # vLLM's: a conversation given as the input
            del data["input"]
        return data

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input or messages")
        # An empty text is taken, as vLLM takes it: an encoder frames it ([CLS] [SEP]); one that
        # tokenizes to nothing is a 400 saying the prompt is empty (OpenAIServing._check_prompts)
        if self.input is not None and (self.input == [] or (isinstance(self.input, list) and [] in self.input)):
            raise ValueError("input must not be empty, nor hold an empty list of token ids")
        _check_template_options(self)
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids."""
        p = self.input
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


class EmbeddingRequest(InputPoolingFields):
    """POST /v1/embeddings (OpenAI's; vLLM's extras: binary replies, base64's and theirs element
    type and byte order)."""
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    dimensions: int | None = Field(None, ge=1)
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"


class ClassificationRequest(InputPoolingFields):
    """POST /classify (vLLM's): each input's class probabilities, from a sequence classifier."""


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): an embedding request, with the pooling `task` named: "embed" on an
    embedding model, "classify" on a classifier, "token_classify" on a token classifier (each
    model's first task by default)."""
    task: str | None = None
