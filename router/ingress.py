"""The Serve ingress deployment: HTTP in, tokenize, engine replicas (through a handle), HTTP out.

    client --HTTP--> Serve proxy --> OpenAIIngress (FastAPI: auth, schema, chat template, tokenize)
                                       --handle.generate(stream)--> EngineServer replica (AsyncEngine)
           <--SSE / JSON------------ <--StepOutput per engine step---

A client that disconnects makes the proxy cancel this request; the SSE body or the awaiting
handler is closed, which cancels the handle stream, which cancels the replica's generator,
which aborts the engine request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

from ray import serve
from ray.serve.context import _set_request_context
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from router.api import Admission, build_api
from router.cluster_metrics import ClusterMetrics
from router.errors import from_invalid_request, overloaded, unavailable
from router.response_store import ResponseStore
from router.serving import OpenAIServing
from router.session import current_session
from router.settings import RouterSettings
from workers.serve_logging import log_through_serve

logger = logging.getLogger(__name__)

MAX_REPLICA_RETRIES = 2  # a request whose replica died before it started tries this many others
# ... but after at most this many deaths it may have caused (it was inside the engine, or the
# replica died with no word why): a request that crashes its engine (a query of death) would
# otherwise take down one replica per try.
MAX_SUSPECT_RETRIES = 1
RETRY_BACKOFF_S = 0.2
# An admitted call that finds the queue full asks again after 20 ms, doubling up to 100 ms.
ROOM_BACKOFF_S, MAX_ROOM_BACKOFF_S = 0.02, 0.1
# A new request's call asks once more before its 503: Serve counts a call as queued until its
# router has assigned it a replica, which takes a few ms even when one is free, so of two requests
# arriving together at a queue of one, the second would be refused on an idle server.
NEWCOMER_RETRIES = 1
BACKPRESSURE_LOG_INTERVAL_S = 1.0  # Serve's warnings of refused calls: one a second at most (_QuietBackpressure)
_NOT_AVAILABLE = "The model is not available right now. Retry later."
_NOT_READY_STATES = {"STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"}
READY_INFO_TIMEOUT_S = 2.0  # /ready, when Serve's status lists no engine deployment: an engine must answer by then


class HandleReplicaClient:
    """`router.serving.ReplicaClient` over a Serve handle to the engine deployment."""

    def __init__(self, handle: DeploymentHandle, settings: RouterSettings) -> None:
        self._handle = handle
        # `info` through a handle of its own: Serve's max_queued_requests counts the calls waiting
        # in one handle's router, and an info call waiting for a busy replica's seat would hold
        # a place in the queue that generate calls share (or be refused by it).
        self._info_handle = started(DeploymentHandle(handle.deployment_name, handle.app_name))
        # Plain pickle rather than Serve's cloudpickle for the calls that carry the traffic: the
        # request and every streamed StepOutput are classes both sides import, and cloudpickle's
        # per-object checks cost 2.4x (request) to 6x (StepOutput) of pickle's time to pickle them.
        # Serve applies it on its gRPC transport (cluster.serve_env).
        self._stream = handle.options(stream=True, request_serialization="pickle", response_serialization="pickle")
        self._settings = settings
        self._live: set = set()  # the engine calls in flight
        self._cutting = False
        self.room_waiters = 0  # admitted calls waiting for room in a full queue
        logging.getLogger("ray.serve").addFilter(_QuietBackpressure(self))

    def cut_all(self) -> int:
        """Shutdown, out of time: cancel every engine call in flight (the engines abort them and
        free their KV blocks); each ends its request with a 503 `unavailable` error, an error
        event in a stream, rather than a connection cut mid-stream. -> how many were cut."""
        self._cutting = True
        live = list(self._live)
        for response in live:
            with contextlib.suppress(Exception):
                response.cancel()
        return len(live)

    async def info(self) -> dict:
        try:
            return await self._info_handle.info.remote()
        except BackPressureError as e:
            raise overloaded(e.retry_after_s or self._settings.retry_after_s, self._settings.overload_status) from None
        except (DeploymentUnavailableError, RayActorError):
            raise unavailable(_NOT_AVAILABLE) from None

    def _call_generate(self, **kwargs):
        # Serve gives every handle call made while serving one HTTP request that request's
        # internal id, and its request router indexes pending calls by that id: the calls of a
        # several-prompt request would collide, and all but one would never be assigned. So
        # each engine call gets its own id (in a copied context, leaving the handler's own
        # untouched). Cancellation does not depend on it: `generate` cancels the call itself
        # when its consumer goes away.
        _set_request_context(_internal_request_id=uuid.uuid4().hex)
        session = current_session()  # for --routing session and kv (router.session)
        stream = self._stream if session is None else self._stream.options(session_id=session)
        return stream.generate.remote(**kwargs)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       admitted: bool = False) -> AsyncIterator[StepOutput]:
        """The replica's StepOutputs. A replica that dies before its first output is replaced by
        another (up to `MAX_REPLICA_RETRIES` times); one that dies mid-stream ends it with a 503
        `unavailable` error, as the tokens already sent cannot be taken back.

        A full queue (Serve's max_queued_requests, which counts engine calls) refuses the call
        with a 503 `queue_full`, unless it is `admitted`: a later call of a request its first
        call already let in (another prompt, a beam search round). That one waits for room, so
        a request's own fan-out never has it refused; and while one waits, new requests are
        refused here, so that clients retrying fast cannot take every place it waits for. A new
        request's call is refused on its second try (NEWCOMER_RETRIES)."""
        if not admitted and self.room_waiters:
            raise overloaded(self._settings.retry_after_s, self._settings.overload_status)
        suspect_deaths, attempt, refusals = 0, 0, 0
        waiting = False  # an admitted call counted in room_waiters
        try:
            while True:
                started = False
                try:
                    async for step in self._generate_once(request_id, prompt_token_ids, params):
                        if waiting:  # past the queue
                            self.room_waiters, waiting = self.room_waiters - 1, False
                        started = True
                        yield step
                    return
                except BackPressureError as e:  # the queue in front of the replicas is full
                    if not admitted and (refusals == NEWCOMER_RETRIES or self.room_waiters):
                        raise overloaded(e.retry_after_s or self._settings.retry_after_s,
                                         self._settings.overload_status) from None
                    if admitted and not waiting:
                        self.room_waiters, waiting = self.room_waiters + 1, True
                    await asyncio.sleep(room_backoff(refusals))
                    refusals += 1
                except (RayActorError, EngineDeadError) as e:
                    suspect_deaths += _may_have_caused(e)
                    if started or attempt == MAX_REPLICA_RETRIES or suspect_deaths > MAX_SUSPECT_RETRIES:
                        logger.warning("engine replica failed while serving %s: %r", request_id, e)
                        raise unavailable("The engine replica serving this request failed. Retry.") from None
                    logger.warning("engine replica failed before %s started; retrying on another: %r",
                                   request_id, e)
                    attempt += 1
                    await asyncio.sleep(RETRY_BACKOFF_S * attempt)  # for the routers to hear of the death
        finally:
            self.room_waiters -= waiting

    async def _generate_once(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams) -> AsyncIterator[StepOutput]:
        response, finished = None, False
        if self._cutting:  # shutting down: a request that had not reached an engine yet ends too
            raise _cut_error()
        try:
            # By name: the request router reads the call's arguments (cluster.serve_router).
            response = contextvars.copy_context().run(self._call_generate, request_id=request_id,
                                                      prompt_token_ids=prompt_token_ids, params=params)
            self._live.add(response)
            async for step in response:
                finished = step.finished
                yield step
            if self._cutting and not finished:  # cancelled by cut_all, and the replica's stream just ended
                finished = True
                raise _cut_error()
        except TaskCancelledError:  # cancelled by cut_all (Serve's RequestCancelledError is one)
            if not self._cutting:
                raise
            finished = True
            raise _cut_error() from None
        except BackPressureError:  # refused by a full queue (generate)
            finished = True  # nothing to cancel (and cancelling a rejected request raises again)
            raise
        except DeploymentUnavailableError:
            finished = True
            raise unavailable(_NOT_AVAILABLE) from None
        except InvalidRequestError as e:  # the engine's validate(); arrives wrapped in a RayTaskError
            finished = True
            raise from_invalid_request(getattr(e, "cause", None) or e) from None
        except (RayActorError, EngineDeadError):
            finished = True  # the replica is gone: nothing left to cancel
            raise
        finally:
            self._live.discard(response)
            if response is not None and not finished:
                with contextlib.suppress(Exception):  # keep the exception that brought us here
                    response.cancel()  # the replica's generator is cancelled -> the engine aborts


def started(handle: DeploymentHandle) -> DeploymentHandle:
    """`handle` with its request router started now, in the replica's constructor, rather than at
    its first call. Ray Serve (2.60) fills a new router's replica list and config from a long poll
    of its own, and stops that poll as soon as the process's shared one brings any news of the
    deployment; news of the replicas alone (the engine's replicas changing, as just after start)
    leaves the router without its config, and its calls wait for a change that may never come.
    Seen: an ingress replica's first request, the first call of a router made the moment the
    engine became ready, hung for good. Started here, it has both long before."""
    return handle.options()  # .options() starts the router (the handle's own is lazy)


def room_backoff(refusals: int) -> float:
    """Seconds an admitted call waits after its refusal number `refusals` (from 0): 20 ms doubling
    to MAX_ROOM_BACKOFF_S, however many came before (2 ** 1024 overflows a float: ~100 s of
    refusals once failed the request with a 500)."""
    return min(MAX_ROOM_BACKOFF_S, ROOM_BACKOFF_S * 2 ** min(refusals, 16))


class _QuietBackpressure(logging.Filter):
    """Serve logs a warning for each call a full queue refuses. While admitted calls wait for room
    (`HandleReplicaClient.generate`) those are their retries, several a second, and not news: they
    are dropped. The others, a flood's refused requests (two tries each), are logged at most once
    every BACKPRESSURE_LOG_INTERVAL_S, the next line saying how many were left out; the access log
    still has each request's 503."""

    def __init__(self, client: HandleReplicaClient, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._client, self._clock = client, clock
        self._logged_at, self._left_out = -math.inf, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Request dropped due to backpressure"):
            return True
        if self._client.room_waiters:
            return False
        now = self._clock()
        if now - self._logged_at < BACKPRESSURE_LOG_INTERVAL_S:
            self._left_out += 1
            return False
        if self._left_out:
            record.msg = f"{record.msg} ({self._left_out} more since the last such line, not logged)"
        self._logged_at, self._left_out = now, 0
        return True


def _cut_error():
    return unavailable("The server is shutting down, and this request did not finish within its graceful "
                       "shutdown timeout. Retry.")


def _may_have_caused(e: BaseException) -> bool:
    """Whether the request may be what killed its replica: it was inside the engine when the
    engine died, or the replica's process died (nothing says what it was doing)."""
    cause = getattr(e, "cause", None) or e  # an EngineDeadError arrives wrapped in a RayTaskError
    return not isinstance(cause, EngineDeadError) or cause.admitted


class HandleResponseStore:
    """`router.response_store.ResponseStore` kept by the one replica of `ResponseStoreDeployment`,
    so that every ingress replica finds every stored response."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = started(handle)

    async def put(self, response_id: str, record: dict, run_update: bool = False) -> bool:
        return await self._call("put", response_id, record, run_update)

    async def beat(self, response_id: str, run: str) -> str | None:
        return await self._call("beat", response_id, run)

    async def get(self, response_id: str) -> dict | None:
        return await self._call("get", response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)

    def _call(self, method: str, *args):
        """Each call with a request id of its own (as HandleReplicaClient._call_generate's): a
        background run's poll and its writes go at once, from one HTTP request's context."""
        def call():
            _set_request_context(_internal_request_id=uuid.uuid4().hex)
            return getattr(self._handle, method).remote(*args)
        return contextvars.copy_context().run(call)


class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, settings: RouterSettings, model: EngineConfig | None = None,
                 store: DeploymentHandle | None = None) -> None:
        """model: the engine's configuration, for its model and tokenizer (default: the embedded
        model's). `store`: the response store deployment when there may be more than one ingress
        replica; else this replica keeps its own (settings.responses_store_max_bytes)."""
        from engine.model_source import load_tokenizer, model_dir as find_model_dir, tokenizer_dir

        model = model or EngineConfig()
        model_dir = find_model_dir(model)
        tokenizer = load_tokenizer(tokenizer_dir(model, model_dir), model.trust_remote_code)  # the engine's
        self._engine_name = engine.deployment_name
        settings = settings.resolve_api_key().with_sampling_defaults(model_dir)
        if settings.enable_log_requests:
            log_through_serve("router")  # prompts and params, at INFO
        self._client = HandleReplicaClient(engine, settings)
        self._serving = OpenAIServing(tokenizer, self._client, settings,
                                      HandleResponseStore(store) if store is not None else None)

        self._admission = Admission(settings.retry_after_s)
        self._metrics = ClusterMetrics()

    def __serve_build_asgi_app__(self):
        return build_api(self._serving, ready=self.ready, admission=self._admission, metrics=self._metrics.page)

    async def drain(self, exclude: list[str] = (), wait_s: float = 0.0) -> dict:
        """Stop taking requests (503 + Retry-After, /ready 503); -> this replica's id and how many
        requests it has in flight, answered once none is or after `wait_s` (a long poll: a drain
        makes one call a second, not a log line per poll). `kvserve serve` calls it on SIGTERM /
        SIGINT, on every ingress replica (`exclude`: the ones it has asked, which
        cluster.ingress_router then skips), and waits for 0 before stopping Serve. Background
        responses running here count as in flight."""
        deadline = time.monotonic() + wait_s
        while (in_flight := self._admission.drain() + len(self._serving.background)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"replica": serve.get_replica_context().replica_id.to_full_id_str(), "in_flight": in_flight}

    async def cut(self, exclude: list[str] = ()) -> dict:
        """`kvserve serve`, when the drain runs out of time: end every request still in flight
        here with a 503 `unavailable` error (HandleReplicaClient.cut_all). -> this replica's id
        and how many were cut; `exclude` as in `drain`."""
        return {"replica": serve.get_replica_context().replica_id.to_full_id_str(),
                "in_flight": self._client.cut_all()}

    async def __del__(self) -> None:
        # Serve calls this when it stops the replica, after its HTTP requests (not its background
        # runs); also when __init__ failed, before there was anything to stop
        if (serving := getattr(self, "_serving", None)) is not None:
            await serving.background.shutdown()

    async def ready(self) -> tuple[bool, dict]:
        """True when every replica of the engine deployment is running (its engine loaded); also
        when Serve has scaled it to zero (autoscaling from min_replicas 0: a request starts one),
        and when Serve's status lists no engine deployment but an engine answers: a config update
        that fails to build leaves the running version serving, while the status then lists none
        of the app's deployments (a pod must not turn unready over a typo in its serveConfigV2)."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(serve.get_replica_context().app_name)
        deployment = app.deployments.get(self._engine_name) if app else None
        if deployment is None:
            return await self._engine_answers(), {"replicas": {}}
        states = {getattr(k, "value", str(k)): v for k, v in deployment.replica_states.items()}
        health = getattr(deployment.status, "value", deployment.status)
        if not any(states.values()) and health == "HEALTHY":
            return True, {"replicas": states, "scaled_to_zero": True}
        ok = (states.get("RUNNING", 0) > 0 and not _NOT_READY_STATES & {k for k, v in states.items() if v}
              and health not in ("UNHEALTHY", "DEPLOY_FAILED"))
        return ok, {"replicas": states}

    async def _engine_answers(self) -> bool:
        try:
            await asyncio.wait_for(self._client.info(), READY_INFO_TIMEOUT_S)
            return True
        except Exception:  # none answered in time, or none is there
            return False


IngressDeployment = serve.deployment(name="OpenAIIngress")(serve.ingress()(OpenAIIngress))
# One replica: the store is its memory. No CPU reserved (it only keeps JSON), and as many calls
# at once as the ingress replicas send.
ResponseStoreDeployment = serve.deployment(name="ResponseStore", num_replicas=1, max_ongoing_requests=1000,
                                           ray_actor_options={"num_cpus": 0})(ResponseStore)
