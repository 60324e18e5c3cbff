"""The ingress's configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.chat_format import FORMATS
from engine.lora_request import LoRARequest, ModelDims
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tool_calls import PARSERS as TOOL_FORMATS

MAX_SEQUENCES = 256  # default bound on one generation request's prompts x n
MAX_EMBEDDING_INPUTS = 2048  # and on one embedding request's inputs: OpenAI's


@dataclass(frozen=True)
class RouterSettings:
    served_model_name: str  # the `model` replies name; requests may send it or an alias (404 otherwise)
    served_model_aliases: tuple[str, ...] = ()  # other names requests may send (vLLM's extra --served-model-name)
    model_root: str | None = None  # the model as given to the engine (/v1/models' `root`, as vLLM's)
    api_key: str | None = None  # when set, every route but /health and /ready needs `Bearer <key>`
    # Or the name of an environment variable holding the key, read where the ingress runs (so a
    # Kubernetes Secret can feed it without the key appearing in the Serve config).
    api_key_env: str | None = None
    max_request_body_bytes: int = 8 << 20  # larger bodies get a 413 before they are parsed
    # Prompts x n one request may ask for, and the inputs of one embedding, score or rerank request
    # (400 beyond): without a bound, one request could take every seat of the queue in front of the
    # engine replicas. None: 256 sequences of generation, 2,048 inputs of embeddings (OpenAI's own
    # limit, what its clients batch up to; LangChain sends 1,000).
    max_sequences_per_request: int | None = None
    enable_log_requests: bool = False  # log prompts and sampling params (off: prompts never logged)
    enable_log_outputs: bool = False  # vLLM's: with enable_log_requests, log each sample's text when it ends
    retry_after_s: float = 1.0  # the Retry-After of a 503/429 when the engine queue is full
    overload_status: int = 503  # 503, or 429 as some gateways prefer
    # Memory for stored /v1/responses (previous_response_id, GET /v1/responses/{id}); the least
    # recently used go beyond it. 0: nothing is stored.
    responses_store_max_bytes: int = 64 << 20
    # Background responses (router.background) one ingress replica runs at once; more get the
    # overload status (a run waits for room in the engine queue, where a request is refused).
    max_background_responses: int = 256
    # Where the defaults of the sampling fields a request leaves unset come from (vLLM's
    # --generation-config, engine.generation_config): auto (the model's generation_config.json) |
    # vllm (none: OpenAI's) | a directory; then override_generation_config's fields on top.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # ... as read where the ingress runs (with_sampling_defaults): temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens. Empty until then: OpenAI's defaults.
    sampling_defaults: dict = field(default_factory=dict)
    chat_template: str | None = None  # the Jinja template chat requests are rendered with, instead of the tokenizer's
    # CORS, with vLLM's flag names; no origin by default (vLLM allows all): a page on any site
    # could otherwise read the replies of a server on the user's own machine.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # vLLM's --reasoning-parser: chat replies' <think> block goes to `reasoning` (router.reasoning)
    reasoning_parser: str | None = None
    # vLLM's --tool-call-parser: how the model writes tool calls (router.tools.FORMATS)
    tool_call_parser: str = "hermes"
    # vLLM's --exclude-tools-when-tool-choice-none: tool_choice "none" leaves the tools out of the
    # prompt (by default the model still sees them, and its reply is not parsed for calls)
    exclude_tools_when_tool_choice_none: bool = False
    response_role: str = "assistant"  # vLLM's --response-role: a chat reply's role when it opens a new turn
    # vLLM's --chat-template-content-format (engine.chat_format): auto | string | openai
    chat_template_content_format: str = "auto"
    # vLLM's --lora-modules (engine.lora_request.lora_modules): a request whose `model` names one
    # runs with that adapter; /v1/models lists them after the served names
    lora_modules: tuple[LoRARequest, ...] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # change the modules at run time (router.lora_modules), each checked against max_lora_rank
    allow_runtime_lora_updating: bool = False
    max_lora_rank: int = 16
    # the model's layers and projection shapes, which a module's weights must fit (checked as one
    # loads at run time; None: only at a request's first use, by the engine)
    lora_dims: ModelDims | None = None
    # vLLM's --default-chat-template-kwargs: the chat template's variables, under a request's own
    # chat_template_kwargs (e.g. {"enable_thinking": false} for Qwen3)
    default_chat_template_kwargs: dict | None = None
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:{id}" unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-force-include-usage: every stream carries usage, in each chunk and a last one
    enable_force_include_usage: bool = False
    # vLLM's --sse-keep-alive-interval: an idle stream sends an SSE comment every this many seconds (0: none)
    sse_keep_alive_interval: float = 0.0
    disable_fastapi_docs: bool = False  # vLLM's: no /openapi.json, /docs
    root_path: str | None = None  # vLLM's: FastAPI's root_path, behind a proxy that serves under a path
    max_log_len: int | None = None  # vLLM's: the prompt ids (output characters, ids) a log line shows (None: all)
    # vLLM's structured_outputs_config enable_in_reasoning: with a reasoning parser, a request's
    # grammar governs its whole reply, reasoning included (by default it waits for </think>)
    structured_outputs_in_reasoning: bool = False
    enable_server_load_tracking: bool = False  # vLLM's: GET /load, the requests running the model
    enable_tokenizer_info_endpoint: bool = False  # vLLM's: GET /tokenizer_info

    def __post_init__(self) -> None:
        if not all(isinstance(n, str) and n for n in (self.served_model_name, *self.served_model_aliases)):
            raise ValueError("served_model_name must be a non-empty string, or a list of them")
        if not all(isinstance(m, LoRARequest) for m in self.lora_modules):
            raise ValueError("lora_modules must be LoRARequests (engine.lora_request.lora_modules)")
        names = [self.served_model_name, *self.served_model_aliases, *(m.lora_name for m in self.lora_modules)]
        if len(set(names)) != len(names):
            raise ValueError(f"a LoRA module's name must differ from the served model names and the other modules', "
                             f"got {names}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give api_key or api_key_env, not both")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
        if self.max_sequences_per_request is not None and self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_background_responses < 0:
            raise ValueError(f"max_background_responses must be >= 0, got {self.max_background_responses}")
        if self.responses_store_max_bytes < 0:
            raise ValueError(f"responses_store_max_bytes must be >= 0, got {self.responses_store_max_bytes}")
        if self.chat_template is not None:
            _check_template(self.chat_template)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_FORMATS)}, got {self.tool_call_parser!r}")
        if self.chat_template_content_format not in FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(FORMATS)}, "
                             f"got {self.chat_template_content_format!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role must be a non-empty string, got {self.response_role!r}")
        if self.default_chat_template_kwargs is not None:
            from router.protocol import TEMPLATE_ARGUMENTS

            if not isinstance(self.default_chat_template_kwargs, dict):
                raise ValueError(f"default_chat_template_kwargs must be a JSON object, "
                                 f"got {self.default_chat_template_kwargs!r}")
            if taken := sorted(TEMPLATE_ARGUMENTS & set(self.default_chat_template_kwargs)):
                raise ValueError(f"default_chat_template_kwargs may not set {', '.join(taken)}")
        if not self.sse_keep_alive_interval >= 0:
            raise ValueError(f"sse_keep_alive_interval must be >= 0, got {self.sse_keep_alive_interval}")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("enable_log_outputs (--enable-log-outputs) needs enable_log_requests (--enable-log-requests), "
                             "as in vLLM")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.root_path is not None and not (self.root_path == "" or self.root_path.startswith("/")):
            raise ValueError(f"root_path must start with /, got {self.root_path!r}")
        if self.overload_status not in (429, 503):
            raise ValueError(f"overload_status must be 429 or 503, got {self.overload_status}")

    def sequence_limit(self, pooling: bool = False) -> int:
        """The bound on one request's sequences (generation: prompts x n) or inputs (`pooling`:
        embeddings, scores, reranking)."""
        if self.max_sequences_per_request is not None:
            return self.max_sequences_per_request
        return MAX_EMBEDDING_INPUTS if pooling else MAX_SEQUENCES

    def with_sampling_defaults(self, model_dir) -> "RouterSettings":
        """These settings with sampling_defaults read from generation_config (the model's
        directory is `model_dir`); a bad file or override is an error naming it."""
        from engine.generation_config import sampling_defaults
        from router.protocol import check_sampling_values  # what a request could send

        return replace(self, sampling_defaults=sampling_defaults(self.generation_config, model_dir,
                                                                 self.override_generation_config,
                                                                 check_sampling_values))

    def resolve_api_key(self) -> "RouterSettings":
        """These settings with api_key_env replaced by the key it names; an unset or empty
        variable is an error (an ingress must not come up open when a key was asked for)."""
        if self.api_key_env is None:
            return self
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"api_key_env names ${self.api_key_env}, which is unset or empty here")
        return replace(self, api_key=key, api_key_env=None)


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the text of the file `value` names, else `value` itself when it
    looks like a template (a missing file is an error, not a one-line template)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat_template {value!r}: no such file, nor a Jinja template")
    return value


def _check_template(text: str) -> None:
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template: {e.message} (line {e.lineno})") from None
