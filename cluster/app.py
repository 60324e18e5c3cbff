"""The kvserve Serve application, built from one flat dict of arguments.

Used by `kvserve serve`, by `serve run` with a config file and by KubeRay's `serveConfigV2`:

    applications:
      - name: kvserve
        route_prefix: /
        import_path: cluster.app:build_app
        args: {model: /models/llama, tensor_parallel_size: 2, num_replicas: 2, max_model_len: 4096,
               routing: kv, autoscale: kv, min_replicas: 1, max_replicas: 4, upscale_delay_s: 30}

Keys named like `engine.config.EngineConfig` fields configure every engine replica; the others
are `ServeOptions` below. Unknown keys are an error, so a typo fails the deploy instead of being
silently ignored.

    OpenAIIngress (FastAPI)  --handle-->  EngineServer x num_replicas
    num_cpus 0, many requests             one AsyncEngine each; with tensor_parallel_size > 1 a
                                          STRICT_PACK placement group (one node): bundle 0 for
                                          the replica, then one bundle per rank of its group

Before anything is deployed, cluster.sizing checks that a replica fits the Ray nodes in sight
and can read its checkpoint within load_timeout_s; with max_surge_percent, a config change starts
the new replicas before the old ones stop, so serving goes on through it.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass

from cluster import sizing
from cluster.policy import ROUTERS
from engine.config import EngineConfig
from workers.serve_logging import UVICORN_LOG_LEVELS, serve_logging_config

APP_NAME = "kvserve"
AUTOSCALE_POLICIES = ("none", "kv", "requests")
# ServeOptions that only `autoscale` kv|requests reads: set without it, they would be ignored
AUTOSCALE_ONLY = ("min_replicas", "max_replicas", "upscale_delay_s", "downscale_delay_s", "target_kv_usage",
                  "target_ongoing_requests", "look_back_period_s", "metrics_interval_s")
INGRESS_MAX_ONGOING_REQUESTS = 4096  # the ingress only parses and relays; the engine bounds the work
# A stopping ingress (an upgrade replaces it with the engine replicas) waits this much longer than
# an engine replica for its streams: a stream then ends the engine's way, whole or with its
# engine's error event and [DONE], not cut by the ingress's own stop at the same deadline.
INGRESS_EXTRA_GRACE_S = 30.0
# vLLM's: when true, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the LoRA modules
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class ServeOptions:
    # The `model` names requests may send; replies name the first. Default: --model as given, or
    # the embedded model's name.
    served_model_name: str | list[str] | None = None
    api_key: str | None = None  # require `Authorization: Bearer <key>` (all routes but /health, /ready)
    api_key_env: str | None = None  # or: the environment variable holding that key where the ingress runs
    # Engine replicas (each one engine, or one tensor-parallel group): the fixed count (default 1);
    # with `autoscale`, the count to start from (Serve's initial_replicas, default min_replicas).
    num_replicas: int | None = None
    autoscaling_config: dict | None = None  # raw Serve autoscaling of the engine replicas
    max_ongoing_requests: int | None = None  # requests in flight per engine replica; default: max_num_seqs
    max_queued_requests: int = -1  # requests waiting for a replica, per ingress replica, before a 503 (-1: no limit)
    # The ingress's limits (router.settings.RouterSettings; None: its default).
    overload_status: int | None = None  # 503, or 429, for a full queue
    retry_after_s: float | None = None  # Retry-After of that reply
    max_request_body_bytes: int | None = None
    max_sequences_per_request: int | None = None  # prompts x n, or an embedding request's inputs, in one request
    responses_store_max_bytes: int | None = None  # memory for stored /v1/responses (0: none)
    max_background_responses: int | None = None  # background responses running at once, per ingress replica
    enable_log_requests: bool | None = None  # log prompt token ids and sampling params (never by default)
    enable_log_outputs: bool | None = None  # vLLM's: with enable_log_requests, each sample's text when it ends
    disable_log_stats: bool = False  # vLLM's: no periodic stats line in the engine replicas' logs
    # vLLM's name: no access line per request (and per /ready probe, per engine call) in the replicas' logs
    disable_uvicorn_access_log: bool = False
    # vLLM's --uvicorn-log-level: the level of Serve's own lines in the replicas' logs (access lines,
    # replica events; trace is debug); kvserve's own (model loaded, stats) keep theirs. None: Serve's
    uvicorn_log_level: str | None = None
    # vLLM's: where requests' sampling defaults come from (engine.generation_config): auto (the
    # model's generation_config.json) | vllm (none) | a directory; then these fields on top
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    chat_template: str | None = None  # a Jinja file, or the template itself, instead of the tokenizer's
    allowed_origins: list[str] | None = None  # CORS (router.settings.RouterSettings); none by default
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    allow_credentials: bool | None = None
    reasoning_parser: str | None = None  # vLLM's: deepseek_r1 | qwen3 (router.reasoning); none by default
    tool_call_parser: str | None = None  # vLLM's: hermes (the default) | llama3_json (router.tools)
    exclude_tools_when_tool_choice_none: bool | None = None  # vLLM's: tool_choice none hides the tools
    response_role: str | None = None  # vLLM's: a chat reply's role when it opens a new turn (default: assistant)
    chat_template_content_format: str | None = None  # vLLM's: auto | string | openai (engine.chat_format)
    # vLLM's --lora-modules: `name=path` strings, or {"name", "path", "base_model_name"} dicts (or
    # their JSON); a request's `model` names one (needs the engine's enable_lora)
    lora_modules: list | None = None
    # vLLM's server flags (router.settings.RouterSettings; None: its default)
    default_chat_template_kwargs: dict | None = None
    return_tokens_as_token_ids: bool | None = None
    enable_force_include_usage: bool | None = None
    sse_keep_alive_interval: float | None = None
    disable_fastapi_docs: bool | None = None
    root_path: str | None = None
    max_log_len: int | None = None
    enable_server_load_tracking: bool | None = None
    enable_tokenizer_info_endpoint: bool | None = None
    # vLLM's structured_outputs_config (engine.vllm_args.STRUCTURED_OUTPUTS_KEYS): its reasoning_parser
    # is reasoning_parser's, enable_in_reasoning puts the grammar over the reasoning too
    structured_outputs_config: dict | None = None
    engine_cls: str | Callable | None = None  # "module:Class" built as cls(EngineConfig); default AsyncEngine
    cpu_threads: int | None = None  # torch threads per engine replica on CPU; default: cores // replicas
    num_ingress_replicas: int = 1
    # Raw Serve autoscaling of the ingress replicas, instead of num_ingress_replicas: each stream
    # is one ongoing request there, and one ingress process relays a few thousand streamed tokens
    # a second (docs/benchmarks.md), less than GPU replicas make.
    ingress_autoscaling_config: dict | None = None
    graceful_shutdown_timeout_s: float = 30.0  # how long a stopping replica (or `kvserve serve`) drains
    health_check_period_s: float = 1.0  # Serve's health check of each engine replica: a dead one shows in /ready
    # Routing of generate calls to engine replicas (cluster.serve_router): kv | pow2 (Serve's default) | round_robin
    routing: str = "kv"
    routing_stats_period_s: float = 0.5  # how often replicas report their KV state to the routers
    # Autoscaling of the engine replicas (cluster.autoscale): none (fixed num_replicas) | kv | requests
    autoscale: str = "none"
    min_replicas: int = 1
    max_replicas: int | None = None  # required with autoscale kv|requests
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    target_kv_usage: float = 0.75  # autoscale kv: mean KV block usage to aim for
    target_ongoing_requests: float | None = None  # autoscale requests: Serve's target (default: Serve's)
    look_back_period_s: float = 30.0  # window Serve averages the replicas' metrics over
    metrics_interval_s: float | None = None  # how often replicas push metrics (default: Serve's, 10 s)
    # Start-up and upgrades of the engine replicas
    load_timeout_s: float = 900.0  # tp > 1: reading + scattering the weights (rank 0 reads them all)
    weights_read_bytes_per_s: float = sizing.DEFAULT_READ_BYTES_PER_S  # stated volume read rate, for the check
    # Extra replicas (percent of the target count, rounded up) a config change may start before old
    # ones stop: 100 keeps full capacity through an upgrade at the cost of one more replica's
    # devices meanwhile, and waits until the cluster has them (an autoscaler adds a node; on a full
    # fixed cluster the update never finishes); 0, Serve's default, stops old replicas first (an
    # outage at 1 replica). The KubeRay profiles set 25 or 100.
    max_surge_percent: int = 0
    check_nodes: bool = True  # refuse to deploy when no Ray node in sight can hold a replica

    def __post_init__(self) -> None:
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {', '.join(ROUTERS)}, got {self.routing!r}")
        if not self.routing_stats_period_s > 0:
            raise ValueError(f"routing_stats_period_s must be > 0, got {self.routing_stats_period_s}")
        if self.autoscale not in AUTOSCALE_POLICIES:
            raise ValueError(f"autoscale must be one of {', '.join(AUTOSCALE_POLICIES)}, got {self.autoscale!r}")
        if self.autoscale != "none":
            if self.autoscaling_config:
                raise ValueError("give autoscale or a raw autoscaling_config, not both")
            if self.max_replicas is None:
                raise ValueError(f"autoscale {self.autoscale} needs max_replicas")
            if self.num_replicas is not None and not self.min_replicas <= self.num_replicas <= self.max_replicas:
                raise ValueError(f"with autoscale, num_replicas (the initial count) must be within min_replicas.."
                                 f"max_replicas = {self.min_replicas}..{self.max_replicas}, got {self.num_replicas}")
            self.kv_autoscale_config()  # validates min/max, delays, target_kv_usage
            if not self.look_back_period_s > 0 or (self.metrics_interval_s is not None and not self.metrics_interval_s > 0):
                raise ValueError("look_back_period_s and metrics_interval_s must be > 0")
            if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
                raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if self.autoscaling_config and self.num_replicas is not None:
            raise ValueError("give num_replicas or an autoscaling_config (with its initial_replicas), not both")
        if self.autoscaling_config:
            _check_serve_autoscaling("autoscaling_config", self.autoscaling_config)
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_ingress_replicas < 1:
            raise ValueError(f"num_ingress_replicas (--api-server-count) must be >= 1, got {self.num_ingress_replicas}")
        if self.ingress_autoscaling_config is not None:
            if self.num_ingress_replicas != 1:
                raise ValueError("give num_ingress_replicas or an ingress_autoscaling_config, not both")
            _check_serve_autoscaling("ingress_autoscaling_config", self.ingress_autoscaling_config)
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.max_queued_requests < -1 or self.max_queued_requests == 0:
            raise ValueError(f"max_queued_requests must be >= 1, or -1 for no limit, got {self.max_queued_requests}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if not self.load_timeout_s > 0 or not self.weights_read_bytes_per_s > 0:
            raise ValueError("load_timeout_s and weights_read_bytes_per_s must be > 0")
        if not 0 <= self.max_surge_percent <= 100:
            raise ValueError(f"max_surge_percent must be within 0..100, got {self.max_surge_percent}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if self.autoscale == "none" and (given := [n for n in AUTOSCALE_ONLY if getattr(self, n) != defaults[n]]):
            raise ValueError(f"{', '.join(given)}: for autoscale kv|requests (--autoscale); without it the engine "
                             "replicas are num_replicas (a raw autoscaling_config has its own fields)")
        if not self.graceful_shutdown_timeout_s >= 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be >= 0, got {self.graceful_shutdown_timeout_s}")
        if not self.health_check_period_s > 0:
            raise ValueError(f"health_check_period_s must be > 0, got {self.health_check_period_s}")
        if isinstance(self.served_model_name, (list, tuple)) and not self.served_model_name:
            raise ValueError("served_model_name must be a name or a non-empty list of names, got []")

    def kv_autoscale_config(self):
        from cluster.autoscale import KVAutoscaleConfig

        return KVAutoscaleConfig(min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                                 target_kv_usage=self.target_kv_usage, upscale_delay_s=self.upscale_delay_s,
                                 downscale_delay_s=self.downscale_delay_s)

    def engine_autoscaling_config(self) -> dict | None:
        """The engine deployment's Serve autoscaling_config: the raw one given, else the one
        `autoscale` builds (cluster.autoscale.serve_autoscaling_config), else None (fixed replicas)."""
        if self.autoscaling_config:
            return self.autoscaling_config
        if self.autoscale == "none":
            return None
        from cluster.autoscale import serve_autoscaling_config

        out = serve_autoscaling_config(self.autoscale, self.kv_autoscale_config(),
                                       target_ongoing_requests=self.target_ongoing_requests,
                                       look_back_period_s=self.look_back_period_s)
        if self.metrics_interval_s is not None:
            out["metrics_interval_s"] = self.metrics_interval_s
        if self.num_replicas is not None:
            out["initial_replicas"] = self.num_replicas
        return out

    @property
    def surge_replicas(self) -> int:
        """Replicas an upgrade may add on top of the most the app runs (Serve rounds up)."""
        return -(-self.max_surge_percent * self.max_engine_replicas // 100)

    @property
    def max_engine_replicas(self) -> int:
        """The most engine replicas this app may run (for sizing CPUs and threads)."""
        if self.autoscaling_config:
            return int(self.autoscaling_config.get("max_replicas", 1))
        if self.autoscale != "none":
            return max(1, self.max_replicas)
        return self.num_replicas or 1

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def split_args(args: dict) -> tuple[EngineConfig, ServeOptions]:
    """Validate the flat argument dict into the engine's config and the serving options."""
    args = {k: v for k, v in (args or {}).items() if v is not None}
    known = EngineConfig.field_names() | ServeOptions.field_names()
    unknown = sorted(set(args) - known)
    if unknown:
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, 1)) else k
                 for k in unknown]
        raise ValueError(f"unknown kvserve app argument(s): {', '.join(hints)}")
    engine = EngineConfig(**_typed(EngineConfig, args))
    options = ServeOptions(**_typed(ServeOptions, args))
    return engine, options


def _typed(cls, args: dict) -> dict:
    """The arguments that are `cls`'s fields, checked against their declared types (pydantic's lax
    mode: a templated config's "512" or "false" is read as the number or the flag it spells); a
    value of another type is an error naming its argument."""
    from pydantic import TypeAdapter, ValidationError

    hints = typing.get_type_hints(cls)
    out = {}
    for name in cls.field_names() & set(args):
        try:
            out[name] = TypeAdapter(hints[name]).validate_python(args[name])
        except ValidationError as e:
            raise ValueError(f"{name}={args[name]!r}: {e.errors()[0]['msg']}") from None
    return out


def _check_serve_autoscaling(name: str, config: dict) -> None:
    """What Serve would refuse at deploy time, refused here with the argument's name."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a mapping (Serve's autoscaling_config), got {type(config).__name__}")
    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:  # Serve would ignore them: a misspelt max_replicas would silently not scale
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}")
    try:
        AutoscalingConfig(**config)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"{name}{'.' + where if where else ''}: {error['msg'].removeprefix('Value error, ')}") from None
    except (ImportError, AttributeError) as e:  # Serve imports a custom policy as it reads the config
        raise ValueError(f"{name}.policy: cannot import its policy_function ({e})") from None


def check_args(args: dict) -> tuple[EngineConfig, ServeOptions]:
    """Everything that can be checked before the app deploys: the arguments, the model directory
    (the default model is converted here, once), whether the model splits tensor_parallel_size
    ways, and whether a replica fits the Ray nodes in sight and loads within load_timeout_s."""
    from engine.model.loader import load_arch
    from engine.model.quantized import check_method
    from engine.model_source import model_dir as find_model_dir, tokenizer_dir
    from engine.pooling import resolve_runner

    engine, options = split_args(args)
    model_dir = find_model_dir(engine)
    tokenizer_dir(engine, model_dir)  # a tokenizer named is a directory, or in the Hugging Face cache
    arch, hf_config = load_arch(model_dir)
    check_method(engine.quantization, arch.quantization)
    engine.model_len(arch.max_position_embeddings)  # max_model_len within the model's positions
    if engine.tensor_parallel_size > 1:
        arch.check_tp(engine.tensor_parallel_size)
    router_settings(engine, options).with_sampling_defaults(model_dir)  # the ingress's limits and defaults are valid
    check_sizing(engine, options, arch, model_dir,
                 pooling=resolve_runner(engine.runner, engine.convert, model_dir, hf_config) == "pooling")
    return engine, options


def check_sizing(engine: EngineConfig, options: ServeOptions, arch, model_dir=None,
                 nodes: list[sizing.NodeShape] | None = None, pooling: bool = False) -> sizing.ReplicaNeeds:
    """cluster.sizing's check of one replica against `nodes` (default: the alive Ray nodes that
    could host it, when Ray is up and options.check_nodes). `pooling`: the replica pools. Raises
    sizing.SizingError."""
    gpu = use_gpu(engine)
    if engine.load_format == "dummy":  # nothing is read; random float weights, held as a float32 checkpoint's
        ckpt_dtype, ckpt_bytes = "float32", 0
    else:
        ckpt_dtype = sizing.checkpoint_dtype(model_dir)
        ckpt_bytes = sizing.checkpoint_bytes(model_dir, arch, sizing.DTYPE_BYTES[ckpt_dtype])
    needs = sizing.replica_needs(engine, arch, ckpt_bytes, gpu, pooling, ckpt_dtype)
    if nodes is None:
        import ray

        nodes = sizing.ray_nodes(gpu) if options.check_nodes and ray.is_initialized() else []
    sizing.check(needs, nodes, options.load_timeout_s, options.weights_read_bytes_per_s)
    return needs


def served_model_names(engine: EngineConfig, options: ServeOptions) -> list[str]:
    """The names requests may send as `model`; replies name the first (vLLM's rule)."""
    from engine.model_source import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME

    names = options.served_model_name
    if isinstance(names, str):
        names = [names]
    if names:
        return list(names)
    return [DEFAULT_MODEL_NAME if engine.model in DEFAULT_MODEL_ALIASES else engine.model]


def served_model_name(engine: EngineConfig, options: ServeOptions) -> str:
    return served_model_names(engine, options)[0]


def router_settings(engine: EngineConfig, options: ServeOptions):
    """The ingress's settings: the options named like RouterSettings fields, where given."""
    from engine.lora_request import ModelDims, lora_modules
    from engine.model.loader import load_arch
    from engine.model_source import model_dir
    from router.settings import RouterSettings, load_chat_template

    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(RouterSettings)
             if f.name in ServeOptions.field_names() and getattr(options, f.name) is not None}
    first, *others = served_model_names(engine, options)
    given.update({k: tuple(v) for k, v in given.items() if k.startswith("allowed_")})  # JSON lists
    if options.chat_template is not None:  # read here: its text travels to the ingress with the settings
        given["chat_template"] = load_chat_template(options.chat_template)
    if options.lora_modules and not engine.enable_lora:
        raise ValueError("lora_modules (--lora-modules) needs the engine's enable_lora (--enable-lora)")
    if engine.enable_lora:  # each module's weights checked against the model's shapes, as the engine will
        given["lora_dims"] = ModelDims.of(load_arch(model_dir(engine))[0])
        given["lora_modules"] = lora_modules(options.lora_modules, engine.max_lora_rank, given["lora_dims"])
    if options.structured_outputs_config:
        given.update(_structured_outputs_settings(options.structured_outputs_config, options.reasoning_parser))
    if os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true"):  # vLLM's variable, read as it reads it
        if not engine.enable_lora:
            raise ValueError(f"{RUNTIME_LORA_ENV} needs the engine's enable_lora (--enable-lora)")
        if options.num_ingress_replicas != 1 or options.ingress_autoscaling_config:
            raise ValueError(f"{RUNTIME_LORA_ENV} needs one ingress replica: each keeps its own LoRA modules, and "
                             "an adapter loaded through one would be unknown to the others")
        given.update(allow_runtime_lora_updating=True, max_lora_rank=engine.max_lora_rank)
    return RouterSettings(**{**given, "served_model_name": first, "served_model_aliases": tuple(others),
                             "model_root": engine.model or first})


def _structured_outputs_settings(config: dict, reasoning_parser: str | None) -> dict:
    """RouterSettings fields from vLLM's structured_outputs_config (the rest asks nothing here)."""
    from engine.vllm_args import structured_outputs_config

    config = structured_outputs_config(config)
    out = {"structured_outputs_in_reasoning": config.get("enable_in_reasoning", False)}
    if parser := config.get("reasoning_parser"):
        if reasoning_parser not in (None, parser):
            raise ValueError(f"reasoning_parser {reasoning_parser!r} and structured_outputs_config's "
                             f"reasoning_parser {parser!r} disagree; give one")
        out["reasoning_parser"] = parser
    return out


def engine_bundles(tensor_parallel_size: int, use_gpu: bool) -> list[dict[str, float]]:
    """Bundle 0 holds the replica (scheduler, no device); bundle 1 + r holds rank r. Placed with
    STRICT_PACK: all on one node, since the ranks rendezvous over loopback."""
    rank = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    return [{"CPU": 1.0}] + [dict(rank) for _ in range(tensor_parallel_size)]


def use_gpu(engine: EngineConfig) -> bool:
    """Whether the ranks' bundles hold GPUs (the replica's worker group reads the decision there)."""
    return engine.device.startswith("cuda") or (engine.device == "auto" and _cluster_has_gpus())


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_router_config(engine: EngineConfig, options: ServeOptions):
    """The engine deployment's request_router_config for `routing` (cluster.serve_router)."""
    from cluster.serve_router import request_router_config

    from engine.model_source import tokenizer_dir

    kwargs = {}
    if options.routing == "kv":  # what the router assumes before the first report / for max_tokens=None
        kwargs["default_block_size"] = engine.block_size
        if engine.max_model_len:
            kwargs["default_max_tokens"] = engine.max_model_len
    elif options.routing in ("prefix_affinity", "cache_aware"):  # these match prompts as text, as their authors do
        kwargs["tokenizer"] = str(tokenizer_dir(engine))
        if engine.trust_remote_code:
            kwargs["trust_remote_code"] = True
    return request_router_config(options.routing, options.routing_stats_period_s, **kwargs)


def engine_deployment_options(engine: EngineConfig, options: ServeOptions) -> dict:
    tp = engine.tensor_parallel_size
    gpu = use_gpu(engine)
    opts = {
        "max_ongoing_requests": options.max_ongoing_requests or engine.max_num_seqs,
        "max_queued_requests": options.max_queued_requests,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s,
        "health_check_period_s": options.health_check_period_s,
        "max_constructor_retry_count": 3,  # a model that fails to load rarely loads on the 20th try
        "max_surge_percent": options.max_surge_percent,
    }
    autoscaling = options.engine_autoscaling_config()
    if autoscaling:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = options.num_replicas or 1
    opts["request_router_config"] = engine_router_config(engine, options)
    from workers.group import LOAD_TIMEOUT_ENV  # where the replica's worker group reads its load timeout

    env = {"runtime_env": {"env_vars": {LOAD_TIMEOUT_ENV: repr(float(options.load_timeout_s))}}}
    if tp > 1:
        opts["placement_group_bundles"] = engine_bundles(tp, gpu)
        opts["placement_group_strategy"] = "STRICT_PACK"
        opts["ray_actor_options"] = {"num_cpus": 1, **env}  # must fit bundle 0
    else:
        opts["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1 if gpu else 0}
    return {**opts, **_logging(options)}


def _logging(options: ServeOptions) -> dict:
    """A deployment's Serve logging options: none but Serve's defaults, unless access lines are off
    or Serve's lines are given a level."""
    config = serve_logging_config(not options.disable_uvicorn_access_log, options.uvicorn_log_level)
    return {"logging_config": config} if config else {}


def ingress_deployment_options(options: ServeOptions) -> dict:
    opts = {"max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": 0},  # 0 CPUs: a new ingress can start before the old one stops
            "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s + INGRESS_EXTRA_GRACE_S,
            "max_surge_percent": 100}
    opts.update(_logging(options))
    if options.ingress_autoscaling_config:
        opts["autoscaling_config"] = options.ingress_autoscaling_config
        return opts
    opts["num_replicas"] = options.num_ingress_replicas
    if options.num_ingress_replicas > 1:
        # So that `kvserve serve`'s drain reaches each (cluster.ingress_router). The proxies
        # import it: only where there is more than one, one ingress is routed as Serve's default.
        from cluster.ingress_router import ingress_router_config

        opts["request_router_config"] = ingress_router_config()
    return opts


def build_app(args: dict | None = None):
    """The Serve application (a bound ingress deployment) for these arguments."""
    from router.ingress import IngressDeployment
    from workers.server import EngineDeployment

    engine, options = check_args(args or {})
    settings = router_settings(engine, options)
    engine_opts = engine_deployment_options(engine, options)
    cpu_threads = options.cpu_threads
    if cpu_threads is None and engine_opts["ray_actor_options"].get("num_gpus", 0) == 0 and engine.tensor_parallel_size == 1:
        cpu_threads = max(1, _usable_cores() // options.max_engine_replicas)
    engine_app = EngineDeployment.options(**engine_opts).bind(engine, options.engine_cls, cpu_threads,
                                                              settings.served_model_name,
                                                              log_stats=not options.disable_log_stats)
    ingress = IngressDeployment.options(**ingress_deployment_options(options))
    store = None
    if settings.responses_store_max_bytes and (options.num_ingress_replicas > 1 or options.ingress_autoscaling_config):
        from router.ingress import ResponseStoreDeployment  # shared: a follow-up may reach another ingress

        store = ResponseStoreDeployment.bind(settings.responses_store_max_bytes)
    return ingress.bind(engine_app, settings, engine, store)
