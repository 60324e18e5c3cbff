"""The HTTP surface: a FastAPI app over `OpenAIServing`.

    GET  /health                liveness (no key needed)
    GET  /openapi.json, /docs   the API's OpenAPI document and its browsable page (no key needed)
    GET  /ready                 200 only when every engine replica has loaded (no key needed)
    GET  /v1/models, /v1/models/{model}
    POST /v1/completions        stream: true -> SSE ending in `data: [DONE]`
    POST /v1/chat/completions
    POST /v1/responses          OpenAI's Responses API over the chat path; streams its typed events
    GET, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items   stored responses
    POST /v1/responses/{id}/cancel   a background response (router.background)
    POST /v1/embeddings         on a pooling engine (--runner pooling), as the next three
    POST /pooling               vLLM's: each input's vector in its pooling reply (tasks "embed",
                                "token_embed", "classify", "token_classify")
    POST /classify              vLLM's: each input's class probabilities, from a sequence classifier
    POST /score, /v1/score      vLLM's: text pairs scored by a cross-encoder, or by their embeddings' cosine
    POST /rerank, /v1/rerank, /v2/rerank   vLLM's (Jina's, Cohere's body): documents by their score against a query
    POST /invocations           SageMaker's (vLLM's): a chat request (messages) or a completion (prompt)
    POST /tokenize, /detokenize

Bodies are read here (at most `max_request_body_bytes`, else 413) and validated by the pydantic
models in `router.protocol`; every error leaves as OpenAI error JSON, and an unexpected one as a
500 that says nothing about its cause.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.version import kvserve_version
from router.cluster_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.embeddings import BinaryReply
from router.errors import OpenAIError, bad_request, from_validation_error, internal_error
from router.keep_alive import KeepAlive
from router.lora_modules import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from router.off_loop import off_loop
from router.protocol import (REQUEST_ID_PATTERN, ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                             DetokenizeRequest, EmbeddingRequest, PoolingRequest, TokenizeRequest)
from router.responses import ResponsesRequest
from router.scores import RERANK_PATHS, SCORE_PATHS, RerankRequest, ScoreRequest
from router.serving import OpenAIServing
from router.session import SESSION_HEADER, set_session

logger = logging.getLogger(__name__)

ReadyCheck = Callable[[], Awaitable[tuple[bool, dict]]]


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body: Starlette leaves it suspended when the
    client goes away, and closing it is what aborts the engine requests behind it."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Admission:
    """Whether new requests are taken, and how many are in flight (a stream counts until its
    last byte). Draining: new API requests get a 503 with Retry-After and /ready turns 503, so
    that load balancers stop sending, while the requests in flight finish."""

    def __init__(self, retry_after_s: float = 1.0) -> None:
        self.draining = False
        self.in_flight = 0
        self.generating = 0  # of those, requests on the routes that run the model (vLLM's /load)
        self.retry_after_s = retry_after_s

    def drain(self) -> int:
        """Stop taking new requests; returns how many are still in flight."""
        self.draining = True
        return self.in_flight


class AdmissionGate:
    """ASGI middleware that applies an `Admission` to every HTTP request but the probes, docs and
    metrics (a drain is when a scraper most wants them)."""

    OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/docs", "/metrics", "/version", "/load"})
    # what vLLM's /load counts
    MODEL_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/invocations",
                   "/pooling", "/classify", *SCORE_PATHS, *RERANK_PATHS)

    def __init__(self, app, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "").rstrip("/")
        if root and path.startswith(root + "/"):  # as the routes take it (RootPath)
            path = path[len(root):]
        if scope["type"] != "http" or path in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.admission.draining:
            e = OpenAIError(503, "The server is shutting down; retry on another replica.", type="server_error",
                            code="unavailable", headers={"Retry-After": str(max(1, round(self.admission.retry_after_s)))})
            return await error_response(e)(scope, receive, send)
        generating = path.startswith(self.MODEL_PATHS)
        self.admission.in_flight += 1
        self.admission.generating += generating
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.in_flight -= 1
            self.admission.generating -= generating


class RootPath:
    """ASGI middleware for vLLM's --root-path: the path a proxy serves the API under, in each
    request's scope, so that routes take paths with and without it and the OpenAPI document and
    /docs name it (what FastAPI's own root_path argument did)."""

    def __init__(self, app, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: Request, model: type[BaseModel] | Callable[[object], type[BaseModel]],
                    limit: int) -> BaseModel:
    """The body, validated as `model` (or as the model that `model(parsed body)` picks)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:  # a chunked body states no length up front
                    raise OpenAIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
                          code="request_timeout") from None
    if len(body) > OFF_LOOP_BYTES:
        return await off_loop(_validated, bytes(body), model)
    return _validated(bytes(body), model)


OFF_LOOP_BYTES = 64 << 10  # a body this large is parsed and validated on router.off_loop's thread
# A body still arriving after this is a 408: a client that sends its headers and then trickles (or
# never sends) the body held an ingress seat for good, and ~4k of them took every seat, /health's too.
BODY_READ_TIMEOUT_S = 60.0


def _validated(body: bytes, model: type[BaseModel] | Callable[[object], type[BaseModel]]) -> BaseModel:
    data = parse_json(body)
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e, set(model.model_fields) | getattr(model, "PARAM_NAMES", set())) from None


MAX_JSON_DEPTH = 128  # beyond any OpenAI request (a 60-level nested schema); refused before pydantic walks it


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes):
    """The body as JSON, or a 400 naming what is wrong: not JSON, a non-finite or oversized number,
    nesting deeper than MAX_JSON_DEPTH, or text that is not Unicode (a lone surrogate escape)."""
    try:
        data = json.loads(body, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, a huge integer, NaN / Infinity
        raise _invalid_json(getattr(e, "msg", None) or str(e)) from None
    _check_tree(data)
    return data


def _check_tree(data) -> None:
    """Depth and strings of a parsed body, walked without recursion."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise _invalid_json("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                                    "Unicode text") from None
        elif isinstance(node, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                stack.append((v, depth + 1))
                if isinstance(k, str):
                    stack.append((k, depth))


def _invalid_json(why: str) -> OpenAIError:
    return OpenAIError(400, f"the request body is not valid JSON: {why}", code="invalid_json")


def _too_deep() -> OpenAIError:
    """Valid JSON, but deeper than a request needs."""
    return OpenAIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels, this server's limit",
                       code="invalid_json")


def _invocation(data) -> type[BaseModel]:
    """Which API a `POST /invocations` body is for, as vLLM tells them apart (chat first)."""
    if isinstance(data, dict) and "messages" in data:
        return ChatCompletionRequest
    if isinstance(data, dict) and "prompt" in data:
        return CompletionRequest
    raise bad_request("Cannot find suitable handler for request. Expected one of: ChatCompletionRequest "
                      "(a body with messages), CompletionRequest (a body with prompt)")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def build_api(serving: OpenAIServing, ready: ReadyCheck | None = None,
              admission: Admission | None = None, metrics: Callable[[], Awaitable[str]] | None = None) -> FastAPI:
    """`metrics`: the Prometheus page GET /metrics serves (router.cluster_metrics); empty without."""
    settings = serving.settings
    admission = admission or Admission(settings.retry_after_s)
    expected = _digest(settings.api_key) if settings.api_key else None

    async def require_key(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # Comparing fixed-length digests keeps the comparison constant-time, length included.
        if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(given.strip()), expected):
            raise OpenAIError(401, "Missing or incorrect API key: send `Authorization: Bearer <key>`.",
                              type="authentication_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    # /openapi.json and /docs need no key, as /health (vLLM serves them the same way).
    docs = not settings.disable_fastapi_docs
    app = FastAPI(title="kvserve", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    reply = functools.partial(_reply, keep_alive_s=settings.sse_keep_alive_interval)
    api = APIRouter(dependencies=[Depends(require_key)])
    limit = settings.max_request_body_bytes

    @app.head("/health", include_in_schema=False)  # load balancers that probe with HEAD
    @app.get("/ping", include_in_schema=False)  # vLLM's, for SageMaker's health check
    @app.post("/ping", include_in_schema=False)
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")  # vLLM's: the server's version, no key needed
    async def server_version():
        return {"version": kvserve_version()}

    @app.head("/metrics", include_in_schema=False)
    @app.get("/metrics", include_in_schema=False)  # vLLM's place for them; no key needed, as vLLM's
    async def prometheus_metrics():
        return Response(await metrics() if metrics is not None else "", media_type=METRICS_CONTENT_TYPE)

    @app.get("/load")  # vLLM's: requests running the model on this ingress replica; 0 unless tracking is on
    async def server_load():
        return {"server_load": admission.generating if settings.enable_server_load_tracking else 0}

    @app.get("/ready")
    async def is_ready():
        if admission.draining:
            return JSONResponse({"ready": False, "draining": True}, status_code=503)
        ok, detail = await ready() if ready is not None else (True, {})
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    @api.get("/v1/models")
    async def models():
        return await serving.models()

    @api.get("/v1/models/{model:path}")  # a served name may hold slashes (org/name)
    async def model(model: str):
        return await serving.model(model)

    def body_route(model: type[BaseModel], method: str):
        """A POST route: its `model` body read (its request id from the header, the session from
        its user) and answered with what OpenAIServing's `method` makes of it."""
        async def route(request: Request):
            body = _with_request_id(request, await read_json(request, model, limit))
            set_session(request.headers.get(SESSION_HEADER), body.user)
            return reply(await getattr(serving, method)(body))
        return route

    for name, paths, body_model, method in (  # score and rerank: vLLM's paths, /v1/... and Cohere's /v2/rerank beside them
            ("completions", ("/v1/completions",), CompletionRequest, "completions"),
            ("chat_completions", ("/v1/chat/completions",), ChatCompletionRequest, "chat"),
            ("embeddings", ("/v1/embeddings",), EmbeddingRequest, "embeddings"),
            ("pooling", ("/pooling",), PoolingRequest, "pooling"),
            ("classify", ("/classify",), ClassificationRequest, "classify"),
            ("score", SCORE_PATHS, ScoreRequest, "score"),
            ("rerank", RERANK_PATHS, RerankRequest, "rerank")):
        for path in paths:
            api.add_api_route(path, body_route(body_model, method), methods=["POST"], name=name,
                              openapi_extra=_json_body(body_model))

    @api.post("/invocations", include_in_schema=False)  # vLLM's, for SageMaker (its /ping is above)
    async def invocations(request: Request):
        body = _with_request_id(request, await read_json(request, _invocation, limit))
        set_session(request.headers.get(SESSION_HEADER), body.user)
        return reply(await (serving.chat(body) if isinstance(body, ChatCompletionRequest) else
                             serving.completions(body)))

    if settings.allow_runtime_lora_updating:  # vLLM's, under VLLM_ALLOW_RUNTIME_LORA_UPDATING
        @api.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
        async def load_lora_adapter(request: Request):
            return await serving.adapters.load(await read_json(request, LoadLoRAAdapterRequest, limit))

        @api.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
        async def unload_lora_adapter(request: Request):
            return serving.adapters.unload(await read_json(request, UnloadLoRAAdapterRequest, limit))

    @api.post("/v1/responses", openapi_extra=_json_body(ResponsesRequest))
    async def responses(request: Request):
        body = await read_json(request, ResponsesRequest, limit)
        set_session(request.headers.get(SESSION_HEADER), body.user)
        return reply(await serving.responses(body))

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        if stream:  # a background stream's events (router.background)
            return reply(await serving.background.events(response_id, starting_after))
        return await serving.stored.retrieve(response_id)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await serving.background.cancel(response_id)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await serving.background.delete(response_id)

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20, after: str | None = None):
        return await serving.stored.input_items(response_id, order, limit, after)

    @api.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(request: Request):
        return await serving.tokenize(await read_json(request, TokenizeRequest, limit))

    if settings.enable_tokenizer_info_endpoint:  # vLLM's; it shows the chat template, so it needs the key
        @api.get("/tokenizer_info")
        async def tokenizer_info():
            return await off_loop(serving.tokenizer_info)

    @api.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(request: Request):
        return await serving.detokenize(await read_json(request, DetokenizeRequest, limit))

    app.include_router(api)
    _add_error_handlers(app)
    app.add_middleware(AdmissionGate, admission=admission)
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path.rstrip("/"))
    if settings.allowed_origins:  # outermost: it answers preflights before any route or key check
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)
    app.openapi = lambda: _openapi(app)
    return app


BODY_MODELS = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, PoolingRequest, ClassificationRequest,
               ScoreRequest, RerankRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest)


def _json_body(model: type[BaseModel]) -> dict:
    """The route's request body in the OpenAPI document (handlers read bodies themselves, for
    the size limit, so FastAPI cannot see it)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=kvserve_version(), routes=app.routes, servers=app.servers or None)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in BODY_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
    return app.openapi_schema


def _with_request_id(request: Request, body: CompletionRequest | ChatCompletionRequest | EmbeddingRequest |
                     ScoreRequest | RerankRequest):
    """The body's request_id names the reply, else the X-Request-Id header. vLLM puts the header
    first, but behind Serve's proxy (and Envoy, nginx, ...) a header is there on every request, put
    by the proxy, so the body's id would never count. A header unfit for an id is left out, not
    refused: proxies set it, not clients."""
    given = request.headers.get("x-request-id")
    if body.request_id is None and given and re.fullmatch(REQUEST_ID_PATTERN, given):
        body.request_id = given
    return body


def _reply(result, keep_alive_s: float = 0.0):
    """A reply's JSON, or its stream (with a comment while idle every keep_alive_s, router.keep_alive)."""
    if isinstance(result, dict):
        return JSONResponse(result)
    if isinstance(result, BinaryReply):
        headers = None if result.metadata is None else {"metadata": json.dumps(result.metadata)}
        return Response(result.body, media_type="application/octet-stream", headers=headers)
    if keep_alive_s > 0:
        result = KeepAlive(result, keep_alive_s)
    return SSEResponse(result, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _add_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, e: OpenAIError):
        return error_response(e)

    async def on_http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(OpenAIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    async def on_bad_params(request: Request, e: RequestValidationError):  # a query or path parameter
        error = e.errors()[0]
        param = str(error["loc"][-1]) if error.get("loc") else None
        return error_response(OpenAIError(400, f"{param}: {error['msg']}", param=param))

    async def on_unexpected(request: Request, e: Exception):
        # Log the cause for operators; send the client nothing about it. No body is logged.
        logger.error("internal error in %s %s", request.method, request.url.path, exc_info=e)
        return error_response(internal_error())

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_bad_params)
    app.add_exception_handler(Exception, on_unexpected)
