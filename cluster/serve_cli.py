"""`kvserve serve`: start Ray + Serve and the OpenAI-compatible server, until Ctrl-C or SIGTERM.

    kvserve serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--num-replicas R] [--api-server-count N]
                  [--max-queued-requests N] [--routing kv|pow2|round_robin|prefix_affinity|cache_aware|session]
                  [--autoscale none|kv|requests --min-replicas N --max-replicas N ...]
                  [engine flags: --model, -tp, --max-model-len, ...]

Without --ray-address it starts a local Ray instance and shuts it down on exit; with one, it
deploys onto that cluster and removes only its own application on exit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time

from cluster.engine_args import absolute_path, add_engine_args, engine_config_from_args, parse_bytes
from cluster.policy import ROUTERS
from engine.chat_format import FORMATS as CONTENT_FORMATS
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tool_calls import PARSERS as TOOL_CALL_PARSERS
from workers.serve_logging import UVICORN_LOG_LEVELS

_SERVE_FLAGS = ("api_key", "served_model_name", "num_replicas", "num_ingress_replicas", "max_ongoing_requests",
                "enable_log_outputs",
                "max_queued_requests", "max_request_body_bytes", "max_sequences_per_request",
                "responses_store_max_bytes", "max_background_responses", "enable_log_requests", "disable_log_stats",
                "disable_uvicorn_access_log", "uvicorn_log_level",
                "routing", "routing_stats_period_s", "autoscale", "min_replicas", "max_replicas", "upscale_delay_s",
                "downscale_delay_s", "target_kv_usage", "target_ongoing_requests", "look_back_period_s",
                "graceful_shutdown_timeout_s", "engine_cls", "cpu_threads", "generation_config",
                "override_generation_config", "chat_template", "allowed_origins", "allowed_methods",
                "allowed_headers", "allow_credentials", "reasoning_parser", "tool_call_parser",
                "exclude_tools_when_tool_choice_none", "response_role", "chat_template_content_format", "lora_modules",
                "default_chat_template_kwargs", "return_tokens_as_token_ids", "enable_force_include_usage",
                "sse_keep_alive_interval", "disable_fastapi_docs", "root_path", "max_log_len",
                "structured_outputs_config", "enable_server_load_tracking", "enable_tokenizer_info_endpoint")
# vLLM's server flags that change nothing here: name -> why
SERVE_NO_EFFECT = {
    "enable_request_id_headers": "Serve's proxy puts X-Request-Id on every reply (the request's own, else one it makes)",
    "enable_prompt_tokens_details": "usage always carries prompt_tokens_details.cached_tokens (the prefix cache's hits)",
}


def add_serve_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (Ray Serve)",
        description="Start Ray Serve with kvserve's OpenAI-compatible API (/v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /health, "
                    "/version, /ready).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model directory, as `vllm serve MODEL` takes it (the same as --model)")
    http = p.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    http.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--ssl-keyfile", type=absolute_path, metavar="FILE",
                      help="serve HTTPS with this private key (PEM), with --ssl-certfile (vLLM's flags; Serve's proxy "
                           "terminates TLS)")
    http.add_argument("--ssl-certfile", type=absolute_path, metavar="FILE", help="the certificate (chain, PEM) for HTTPS")
    http.add_argument("--ssl-ca-certs", type=absolute_path, metavar="FILE",
                      help="CA certificates the HTTPS server loads (as vLLM's; clients are not asked for certificates)")
    http.add_argument("--api-key", type=_api_key, default=_key_from_env(), metavar="KEY",
                      help="require `Authorization: Bearer KEY` (default: $KVSERVE_API_KEY, else vLLM's "
                           "$VLLM_API_KEY; none if both are unset)")
    http.add_argument("--served-model-name", nargs="+", metavar="NAME",
                      help="the model names clients may send; replies name the first (default: --model as "
                           "given, or the embedded model's)")
    http.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                      help="LoRA adapters (PEFT directories) requests may name as their `model`, with "
                           "--enable-lora: name=path, or JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...} "
                           "(vLLM's flag); /v1/models lists them")
    http.add_argument("--max-request-body-bytes", type=parse_bytes, metavar="BYTES",
                      help="larger request bodies get a 413 (default: 8M)")
    http.add_argument("--max-sequences-per-request", type=int, metavar="N",
                      help="prompts x n one request may ask for, or inputs one embedding, score or rerank "
                           "request may send; more get a 400 (default: 256 sequences, 2048 inputs)")
    http.add_argument("--responses-store-max-bytes", type=parse_bytes, metavar="BYTES",
                      help="memory for stored /v1/responses (previous_response_id, GET /v1/responses/{id}); "
                           "the least recently used go beyond it; 0 stores none (default: 64M)")
    http.add_argument("--max-background-responses", type=int, metavar="N",
                      help="background /v1/responses each ingress replica runs at once; more get the overload "
                           "status (503 with Retry-After, as a full queue); 0 turns them off, a 400 (default: 256)")
    http.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=None,
                      help="log each request's prompt token ids and sampling params (off by default)")
    http.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=None,
                      help="vLLM's older spelling of --no-enable-log-requests (the default)")
    http.add_argument("--disable-log-stats", action="store_true", default=None,
                      help="no periodic stats line (throughput, queue, KV use) in each engine replica's log")
    http.add_argument("--disable-uvicorn-access-log", action="store_true", default=None,
                      help="no access line per request, /ready probe and engine call in the replicas' logs "
                           "(Serve's enable_access_log off; vLLM's flag)")
    http.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                      help="the level of Serve's own lines in the replicas' logs (access lines, replica events; "
                           "vLLM's flag for its HTTP server's); kvserve's lines (model loaded, stats) keep theirs "
                           "(default: info)")
    http.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                      help="the chat template (a Jinja file, or the template itself) instead of the tokenizer's")
    http.add_argument("--allowed-origins", type=_json_strings, metavar="JSON",
                      help='CORS: origins browsers may call from, e.g. \'["https://app.example"]\' or \'["*"]\' '
                           "(default: none; vLLM allows all)")
    http.add_argument("--allowed-methods", type=_json_strings, metavar="JSON", help='CORS (default: ["*"])')
    http.add_argument("--allowed-headers", type=_json_strings, metavar="JSON", help='CORS (default: ["*"])')
    http.add_argument("--allow-credentials", action="store_true", default=None, help="CORS (default: off)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM's command lines: tool_choice auto is always served here")
    http.add_argument("--exclude-tools-when-tool-choice-none", action="store_true", default=None,
                      help="tool_choice none leaves the tools out of the prompt (by default the model still "
                           "sees them, as in vLLM, and no call is parsed)")
    http.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS),
                      help="how the model writes tool calls: hermes, <tool_call> blocks (the default; Qwen, "
                           "Hermes), llama3_json, bare JSON objects (Llama 3.1+), mistral, [TOOL_CALLS] lists "
                           "(Mistral), or pythonic (llama4_pythonic), a Python list of calls (Llama 3.2+, 4); "
                           "vLLM's names")
    http.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                      help="chat replies' <think>...</think> reasoning goes to message.reasoning (and "
                           "reasoning_content), the rest to content; qwen3: a reply without the tags is all "
                           "content, deepseek_r1: it begins inside its reasoning (default: none)")
    http.add_argument("--structured-outputs-config", type=_json_object, metavar="JSON",
                      help='vLLM\'s: {"backend": ..., "reasoning_parser": ..., "enable_in_reasoning": true, ...}; one '
                           "backend (llguidance) serves every backend's requests, JSON is always compact and "
                           "objects closed; enable_in_reasoning puts a request's grammar over its reasoning too")
    http.add_argument("--chat-template-content-format", choices=list(CONTENT_FORMATS),
                      help="how the chat template gets a message's content: string (its text parts joined "
                           "by newlines), openai (a list of text parts), auto (openai for a template that "
                           "loops over message content, else string) (default: auto)")
    http.add_argument("--response-role", metavar="ROLE",
                      help="the role of a chat reply that opens a new turn (add_generation_prompt true; "
                           "otherwise the last message's) (default: assistant)")
    http.add_argument("--default-chat-template-kwargs", type=_json_object, metavar="JSON",
                      help='the chat template\'s variables where a request\'s chat_template_kwargs leave them, e.g. '
                           '\'{"enable_thinking": false}\' (Qwen3) (vLLM\'s flag)')
    http.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=None,
                      help='logprobs name tokens "token_id:{id}" unless a request sets return_tokens_as_token_ids '
                           "(vLLM's flag; default: off)")
    http.add_argument("--enable-force-include-usage", action="store_true", default=None,
                      help="every stream carries usage, in each chunk and a last chunk, as if each request set "
                           "stream_options include_usage and continuous_usage_stats (vLLM's flag)")
    http.add_argument("--sse-keep-alive-interval", type=float, metavar="S",
                      help="an idle stream (queued, in its prefill, between tokens) sends an SSE comment line every "
                           "S seconds, for proxies that cut quiet connections (vLLM's flag; default: 0, none)")
    http.add_argument("--disable-fastapi-docs", action="store_true", default=None,
                      help="no /openapi.json and /docs (vLLM's flag)")
    http.add_argument("--root-path", metavar="PATH",
                      help="the path a proxy serves this API under (FastAPI's root_path; routes are taken with "
                           "and without it; vLLM's flag)")
    http.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=None,
                      help="with --enable-log-requests, log each sample's text and finish reason when it ends (its "
                           "token ids at debug) (vLLM's flag)")
    http.add_argument("--max-log-len", type=int, metavar="N",
                      help="with --enable-log-requests, the prompt token ids a logged request shows, and the "
                           "characters and ids of a logged output (default: all)")
    http.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=None,
                      help="GET /load: {\"server_load\": the requests running the model on this ingress replica} "
                           "(0 without it) (vLLM's flag)")
    http.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=None,
                      help="GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's flag; "
                           "needs the key)")
    for name, why in SERVE_NO_EFFECT.items():
        http.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None,
                          help=f"no effect: {why}")
    http.add_argument("--generation-config", metavar="auto|vllm|DIR",
                      help="sampling defaults of requests that leave them unset: auto (the model's "
                           "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
                           "max_new_tokens), vllm (none: OpenAI's), or DIR's generation_config.json (default: auto)")
    http.add_argument("--override-generation-config", type=_json_object, metavar="JSON",
                      help='those fields on top, e.g. \'{"temperature": 0.5}\'')
    cluster = p.add_argument_group("serve")
    cluster.add_argument("--num-replicas", type=int, metavar="R",
                         help="engine replicas (default: 1); with --autoscale, the count to start from "
                              "(default: --min-replicas)")
    cluster.add_argument("-dp", "--data-parallel-size", type=int, metavar="N",
                         help="vLLM's data parallelism: here --num-replicas, each replica a whole engine (its "
                              "-tp ranks included) behind the router")
    cluster.add_argument("--api-server-count", type=int, dest="num_ingress_replicas", metavar="N",
                         help="ingress replicas: the processes that parse requests, apply the chat template, "
                              "tokenize and relay the engines' streams (default: 1; one relays ~3,000 "
                              "streamed tokens/s, docs/benchmarks.md)")
    cluster.add_argument("--max-ongoing-requests", type=int, metavar="N",
                         help="requests in flight per engine replica (default: --max-num-seqs)")
    cluster.add_argument("--max-queued-requests", type=int, metavar="N",
                         help="requests waiting for a replica before a 503 with Retry-After (default: -1, no limit)")
    cluster.add_argument("--routing", choices=list(ROUTERS),
                         help="how requests pick an engine replica: kv (prefix-cache and KV-headroom aware), "
                              "pow2 (Serve's default: power of two choices on queue length), round_robin, "
                              "and the routers users run elsewhere: prefix_affinity (Ray Serve LLM's), "
                              "cache_aware (sgl-router's), session (sticky on the X-Session-ID header, else the "
                              "body's `user`) (default: kv)")
    cluster.add_argument("--routing-stats-period-s", type=float, metavar="S",
                         help="how often replicas report their KV state to the routers (default: 0.5)")
    scale = p.add_argument_group("autoscaling")
    scale.add_argument("--autoscale", choices=["none", "kv", "requests"],
                       help="autoscale the engine replicas: kv (KV block usage, queued prefill tokens, "
                            "preemptions), requests (Serve's ongoing-requests policy), none (fixed "
                            "--num-replicas; default)")
    scale.add_argument("--min-replicas", type=int, metavar="N", help="with --autoscale (default: 1)")
    scale.add_argument("--max-replicas", type=int, metavar="N", help="with --autoscale (required)")
    scale.add_argument("--upscale-delay-s", type=float, metavar="S",
                       help="a scale-up must be wanted this long (default: 30)")
    scale.add_argument("--downscale-delay-s", type=float, metavar="S",
                       help="a scale-down must be wanted this long (default: 300)")
    scale.add_argument("--target-kv-usage", type=float, metavar="F",
                       help="--autoscale kv: mean fraction of KV blocks in use to aim for, in (0, 1] (default: 0.75)")
    scale.add_argument("--target-ongoing-requests", type=float, metavar="N",
                       help="--autoscale requests: ongoing requests per replica to aim for (default: Serve's)")
    scale.add_argument("--look-back-period-s", type=float, metavar="S",
                       help="window the replicas' metrics are averaged over (default: 30)")
    cluster.add_argument("--graceful-shutdown-timeout-s", type=float, metavar="S",
                         help="on SIGTERM / SIGINT, and when Serve stops a replica, how long in-flight requests "
                              "may run on while new ones get 503 (default: 30)")
    cluster.add_argument("--shutdown-timeout", type=float, dest="graceful_shutdown_timeout_s", metavar="S",
                         help="vLLM's name for --graceful-shutdown-timeout-s (0: in-flight requests end at once)")
    cluster.add_argument("--cpu-threads", type=int, metavar="N",
                         help="CPU: torch threads per engine replica (default: the usable cores / replicas)")
    cluster.add_argument("--engine-cls", metavar="MODULE:CLASS",
                         help="the engine each replica builds as CLASS(EngineConfig) (default: engine.AsyncEngine; "
                              "e.g. benchmarks.paced_engine:PacedEngine to measure the serving path alone)")
    cluster.add_argument("--ray-address", metavar="ADDRESS",
                         help="deploy onto this running Ray cluster (default: start a local one)")
    cluster.add_argument("--dashboard", action="store_true", help="start the Ray dashboard with a local Ray")
    cluster.add_argument("--metrics-export-port", type=int, metavar="PORT",
                         help="a local Ray's Prometheus endpoint (http://HOST:PORT/metrics: Serve's and the "
                              "engines' kvserve_* metrics; default: a random free port)")
    add_engine_args(p)
    p.set_defaults(func=run_serve, parser=p)
    return p


def _port(text: str) -> int:
    port = int(text) if text.strip().isdigit() else -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (1-65535)")
    return port


KEY_VARIABLES = ("KVSERVE_API_KEY", "VLLM_API_KEY")  # where --api-key's default comes from, in that order


def _key_from_env() -> str | None:
    """A deployment moved from vLLM keeps its key in $VLLM_API_KEY: read, never served open."""
    return next((os.environ[v] for v in KEY_VARIABLES if os.environ.get(v)), None)


def _api_key(text: str) -> str:
    if not text:  # `--api-key "$KVSERVE_API_KEY"` with the variable unset: refused, not served open
        raise argparse.ArgumentTypeError("empty key (is the variable it came from unset?); leave the flag out "
                                         "to serve without a key")
    return text


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _json_object(text: str) -> dict:
    if not isinstance(value := _json(text), dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def _json_strings(text: str) -> list[str]:
    if not (isinstance(value := _json(text), list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError('not a JSON list of strings, e.g. \'["*"]\'')
    return value


def app_args_from_cli(ns: argparse.Namespace) -> dict:
    """The `cluster.app.build_app` argument dict for these flags (only the ones given)."""
    if ns.model_tag is not None:
        if ns.model_tag.lower() in ("true", "false"):  # older vLLM's `--enable-chunked-prefill False`
            raise ValueError(f"{ns.model_tag!r} is not a model: kvserve's on/off flags take no value "
                             "(--enable-chunked-prefill, --no-enable-chunked-prefill)")
        given = getattr(ns, "model", None)  # engine flags not given are absent (argparse.SUPPRESS)
        if given is not None and given != ns.model_tag:
            raise ValueError(f"the model is given twice: {ns.model_tag} and --model {given}")
        ns.model = ns.model_tag
    args = engine_config_from_args(ns)
    args.update({k: getattr(ns, k) for k in _SERVE_FLAGS if getattr(ns, k, None) is not None})
    if ns.data_parallel_size is not None:
        if args.setdefault("num_replicas", ns.data_parallel_size) != ns.data_parallel_size:
            raise ValueError(f"--data-parallel-size {ns.data_parallel_size} and --num-replicas {args['num_replicas']} "
                             "disagree: they name the same count (engine replicas); give one")
    if len(args.get("served_model_name", ())) == 1:  # one name: the plain string a config file holds
        args["served_model_name"] = args["served_model_name"][0]
    return args


def ready_message(host: str, port: int, model: str, api_key: str | None, https: bool = False,
                  pooling: str | None = None) -> str:
    """The ready line and a curl to paste, which never shows the key: it reads the variable the key
    came from ($KVSERVE_API_KEY, $VLLM_API_KEY), else it holds a placeholder for the --api-key given.
    `pooling`: the model pools (its first task), and the curl asks its route (/v1/embeddings,
    /classify, /pooling) for a vector."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"{'https' if https else 'http'}://{shown}:{port}"
    route = {None: "/v1/chat/completions", "embed": "/v1/embeddings", "classify": "/classify",
             "token_classify": "/pooling"}[pooling]
    body = json.dumps({"model": model, "input": "The capital of France is Paris."} if pooling else
                      {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    auth = ""
    if api_key:
        key = next((f"${v}" for v in KEY_VARIABLES if api_key == os.environ.get(v)), "<the --api-key>")
        auth = f' -H "Authorization: Bearer {key}"'
    return (f"kvserve: ready: {model} at {url} (OpenAI API under {url}/v1; Ctrl-C stops)\n"
            f"  curl {url}{route} -H 'Content-Type: application/json'{auth} -d '{body}'")


def _pools(app_name: str) -> str | None:
    """The first task the application's engine pools for (engine.pooling: runner auto decides by
    the model folder, which the replica reads): "embed", "classify" or "token_classify"; None where it
    generates, or where it cannot tell."""
    from ray import serve

    try:
        info = serve.get_deployment_handle("EngineServer", app_name=app_name).info.remote().result(timeout_s=30)
        from engine.pooling import PoolerConfig

        pooler = info.get("pooler")
        return None if pooler is None else PoolerConfig.from_fields(pooler).tasks[0]
    except Exception:
        return None


METRICS_REPORT_INTERVAL_MS = 1000


def _check_port(host: str, port: int, flag: str = "") -> None:
    """Fails when something listens on host:port. SO_REUSEADDR, as the HTTP server itself binds:
    connections of a server stopped a moment ago linger in TIME_WAIT and must not count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}{f' ({flag})' if flag else ''}: {e.strerror}") from None


RAY_GCS_PORT, RAY_CLIENT_PORT = 6379, 10001  # the ports of an address given without one


def _ray_unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why no Ray cluster answers at an address (host[:port], or ray://host[:port] for Ray
    Client): nothing listens, or what does is not gRPC; else None. "auto" and "local" are left to
    Ray. Ray itself retries an absent cluster for over a minute before it gives up."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon:
        host, port = port, str(RAY_CLIENT_PORT if client else RAY_GCS_PORT)
    if not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"no Ray cluster answers at {address}: {e.strerror or type(e).__name__}"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("0", "false", ""):  # TLS: a handshake this does not make
        import grpc  # Ray's own dependency: its GCS and its client server speak gRPC

        with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return f"something listens at {address}, but it is not a Ray cluster (it does not speak gRPC)"
    return None


def run_serve(ns: argparse.Namespace) -> int:
    from cluster.app import APP_NAME, build_app, check_args, served_model_name
    from engine.model_source import ModelError

    try:  # the cheap checks first, so a typo fails in a second rather than after Ray starts
        args = app_args_from_cli(ns)
        tls = _tls_options(ns)
        engine, options = check_args(args)
        if ns.ray_address is None:
            _check_port(ns.host, ns.port)
            if ns.metrics_export_port is not None:  # Ray's agent would fail on it after 30 s, in its own log
                _check_port("0.0.0.0", ns.metrics_export_port, "--metrics-export-port")
    except (ModelError, ValueError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    if ns.ray_address is not None and (why := _ray_unreachable(ns.ray_address)):
        print(f"kvserve: error: {why}", file=sys.stderr)
        return 1

    from cluster.serve_env import apply_serve_env

    apply_serve_env()  # before Ray starts, so that a local Ray's processes inherit it
    import ray
    from ray import serve

    local = ns.ray_address is None
    tp = engine.tensor_parallel_size
    # Logical CPUs: the replica plus one per rank (the ranks run in the replica's placement group),
    # and room for one more replica, so that Serve can start a replacement while a hung one it gave
    # up on still holds its CPUs; a laptop is oversubscribed on purpose.
    per_replica = 1 + tp if tp > 1 else 1
    need = (options.max_engine_replicas + 1) * per_replica
    local_only = {"num_cpus": max(os.cpu_count() or 1, need), "include_dashboard": ns.dashboard,
                  # Workers push metrics every second (Ray's default is 10 s), as the README promises.
                  "_system_config": {"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS}}
    if ns.metrics_export_port is not None:
        local_only["_metrics_export_port"] = ns.metrics_export_port
    signal.signal(signal.SIGTERM, _stop_starting)
    try:
        # "local": a Ray of our own, even where `ray start` left a cluster that ray.init() would join
        ray.init(address=ns.ray_address or "local", **(local_only if local else {}))
        signal.signal(signal.SIGTERM, _stop_starting)  # again: Ray's driver takes SIGTERM over (a core dump)
    except BaseException as e:  # a cluster that is not there, a local one that did not come up; a signal
        with contextlib.suppress(Exception):
            _shutdown_ray(local)
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:  # Ray's own handler, while ray.init ran
            _stop_starting(signal.SIGTERM, None)
        if not isinstance(e, Exception):
            raise
        where = f"at {ns.ray_address}" if ns.ray_address else "here (its logs: $RAY_TMPDIR, default /tmp/ray)"
        print(f"kvserve: error: Ray did not start {where}: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)
        return 1
    deployed = stopping = False
    try:
        try:  # with Ray up, the replica is checked again against the nodes it sees
            app = build_app(args)
        except (ModelError, ValueError) as e:
            print(f"kvserve: error: {e}", file=sys.stderr)
            return 2
        serve.start(http_options={"host": ns.host, "port": ns.port, **tls})
        if not local and (why := _shared_serve_conflict(ns.host, ns.port, APP_NAME, tls)):
            print(f"kvserve: error: {why}", file=sys.stderr)
            return 1
        deployed = True
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            if _stop_starting.received:  # SIGTERM while it deployed: Serve's wait ended in its error
                raise SystemExit(128 + signal.SIGTERM) from None
            print(f"kvserve: error: the application failed to start: {_startup_failure(serve.status(), APP_NAME) or e}",
                  file=sys.stderr)
            return 1
        print(ready_message(ns.host, ns.port, served_model_name(engine, options), options.api_key, bool(tls),
                            _pools(APP_NAME)), flush=True)
        _wait_for_stop_signal()
        stopping = True
        timeout_s = options.graceful_shutdown_timeout_s
        print(f"kvserve: stopping: new requests get 503, in-flight ones may finish for up to {timeout_s:g}s "
              "(Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        _drain(serve.get_app_handle(APP_NAME), timeout_s)  # says what it left
        return 0
    finally:
        if local:
            try:
                serve.shutdown()
            finally:  # even when a second Ctrl-C cut the drain short: no Ray process outlives us
                _shutdown_ray(local)
        elif deployed:  # only our own application: another one of that name was refused above
            serve.delete(APP_NAME)
        if stopping:  # Ray's own lines about the actors it killed come before this one
            print("kvserve: stopped", file=sys.stderr, flush=True)


def _tls_options(ns: argparse.Namespace) -> dict:
    """Serve's HTTP options for HTTPS (--ssl-keyfile with --ssl-certfile), the files checked now
    where the proxy will read them (a local Ray): a key that does not match its certificate, or one
    encrypted with a password (Serve would need it), fails here, not in the proxy's log."""
    import ssl

    key, cert, ca = ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs
    if (key is None) != (cert is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if key is None:
        if ca is not None:
            raise ValueError("--ssl-ca-certs is for HTTPS: give --ssl-keyfile and --ssl-certfile too")
        return {}
    tls = {"ssl_keyfile": key, "ssl_certfile": cert, **({"ssl_ca_certs": ca} if ca else {})}
    if ns.ray_address is not None:  # the files are the cluster's, at these paths on its proxy's node
        return tls
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key, password="")  # never a prompt: an encrypted key fails
        if ca is not None:
            context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"HTTPS: cannot use --ssl-certfile {cert} with --ssl-keyfile {key}"
                         f"{f' and --ssl-ca-certs {ca}' if ca else ''}: {getattr(e, 'strerror', None) or e}") from None
    return tls


def _shared_serve_conflict(host: str, port: int, app_name: str, tls: dict | None = None) -> str | None:
    """Why `kvserve serve --ray-address` cannot deploy onto this cluster's Serve, or None. A Serve
    already running keeps its HTTP address and its TLS (serve.start only warns and ignores ours),
    and an application of our name there is someone else's, which serve.run would replace and our
    exit delete."""
    from ray import serve
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    if (http.host, http.port) != (host, port):
        return (f"Serve already runs on this cluster, its HTTP proxy at {http.host}:{http.port}, which a new "
                f"application cannot move: pass --host {http.host} --port {http.port} to deploy behind it")
    if (http.ssl_certfile or None) != (tls or {}).get("ssl_certfile"):
        return (f"Serve already runs on this cluster, its HTTP proxy {'with' if http.ssl_certfile else 'without'} "
                "TLS, which a new application cannot change: deploy with the --ssl-* flags it was started with")
    if app_name in serve.status().applications:
        return (f"an application named {app_name!r} already runs on this cluster; deploying would replace it "
                "and stopping would delete it: remove it first (serve shutdown, or serve deploy without it)")
    return None


def _startup_failure(status, app_name: str) -> str:
    """The reason a deployment of the app failed, from Serve's status: its message ends with the
    replica constructor's traceback, whose exception line names the error ("ValueError: KV cache
    budget ..."). '' when no deployment says why."""
    app = status.applications.get(app_name)
    reasons = []
    for name, deployment in (app.deployments.items() if app else ()):
        if str(deployment.status).rsplit(".", 1)[-1] in ("DEPLOY_FAILED", "UNHEALTHY") and deployment.message:
            reasons.append(f"{name}: {_exception_line(deployment.message)}")
    return "; ".join(reasons)


def _exception_line(message: str) -> str:
    """The innermost traceback's exception line ("module.Name: what"), else the last line; a
    replica process that died while starting gets a hint at why."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):")]
    tail = lines[starts[-1] + 1:] if starts else lines
    found = [line for line in tail if not line[0].isspace() and _EXCEPTION_LINE.match(line)]
    line = (found[-1] if found else lines[-1]).strip()
    if line.startswith("ActorDiedError"):
        line += (" (the replica's process died while starting: killed, out of memory, or it exited; "
                 "Ray's logs say which)")
    return line


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")


def _ask_each(method, timeout_s: float, **kwargs) -> dict[str, int]:
    """Call `method` (an ingress handle method taking `exclude`, and `kwargs`) once on every
    ingress replica: a call names the replicas asked so far, and the ingress router
    (cluster.ingress_router) sends it to another, until none is left. -> replica id: its
    answer's in_flight."""
    deadline = time.monotonic() + timeout_s
    answers: dict[str, int] = {}
    while True:
        answer = method.remote(exclude=list(answers), **kwargs).result(
            timeout_s=max(1.0, deadline - time.monotonic()))
        if answer["replica"] in answers:
            return answers
        answers[answer["replica"]] = answer["in_flight"]


def _drain(ingress, timeout_s: float, poll_s: float = 0.2, flush_s: float = 1.0, wait_s: float = 1.0) -> int:
    """Have every ingress replica refuse new requests and wait until none has one in flight or
    `timeout_s` has passed; returns how many were left. Those are then cut: each ends with a 503
    `unavailable` error (an error event in a stream), and `flush_s` lets it reach its client.
    Only then may the proxy and the replicas stop. Each replica's answer waits up to `wait_s`
    for its requests to end (OpenAIIngress.drain)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left_s = max(0.0, deadline - time.monotonic())
            in_flight = _ask_each(ingress.drain, left_s, wait_s=min(wait_s, left_s))
            left = sum(in_flight.values())
            if left == 0 or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        print(f"kvserve: drained {len(in_flight)} ingress replica(s); {left} requests left", file=sys.stderr,
              flush=True)
        if left:
            cut = sum(_ask_each(ingress.cut, 10.0).values())
            print(f"kvserve: drain timed out: {cut} engine calls still running end with a 503 'unavailable' "
                  "error", file=sys.stderr, flush=True)
            time.sleep(flush_s)
    except Exception as e:  # the ingress is gone or stuck: nothing more to wait for
        print(f"kvserve: could not drain the ingress: {e!r}", file=sys.stderr, flush=True)
        return -1
    return left


def _stop_starting(signum: int, _frame) -> None:
    """SIGTERM before the server is ready (a pod stopped while its model loads): stop as Ctrl-C
    does then, through run_serve's `finally` (Serve and the local Ray shut down), and exit 143."""
    _stop_starting.received = True
    print("kvserve: SIGTERM before the server was ready: stopping", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a supervisor's repeats must not cut the shutdown short
    raise SystemExit(128 + signum)


_stop_starting.received = False


def _shutdown_ray(local: bool, grace_s: float = 5.0) -> None:
    """ray.shutdown(); for a Ray of our own, then its processes that are still alive after
    `grace_s` are killed: Ray's agents, which its raylet starts, outlive a Ray stopped while it was
    still starting by a minute or more."""
    import psutil
    import ray

    started = psutil.Process().children(recursive=True) if local else []
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM. The handler only appends to a list: Python runs it between
    this thread's bytecodes, so it must take no lock (a threading.Event deadlocked when a second
    signal landed inside the first one's set(), and the server never stopped)."""
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    while not received:
        time.sleep(0.2)  # not signal.pause(): a signal just before it would be missed
    # Draining now: another Ctrl-C stops at once (KeyboardInterrupt); repeated SIGTERMs (a
    # supervisor, `timeout`) are ignored so the drain can finish.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
