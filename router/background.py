"""Background responses (`background: true`, OpenAI's Responses API): the request is answered at
once with its response `queued`, and runs in a task of the ingress replica that took it. Its
stored record follows the run: in_progress once the first output comes, then completed,
incomplete or failed (router.response_reply.ResponseReply). The record names its run (a token), and
the store takes a run's writes only over its own running record, so that a cancel, a delete or
a later request under the same id is never undone; each poll renews the run's lease on it, and a
record whose run went silent (its replica died) reads failed (router.response_store).

`POST /v1/responses/{id}/cancel` reaches whichever ingress replica the load balancer picks: it
marks the record cancelled, and stops the run at once when it is here. The replica that runs it
reads its record every `poll_s` and stops it when the record is no longer running (cancelled
elsewhere, deleted, or evicted from the store). A drain counts the runs here as requests in
flight; a cut ends their engine calls as it ends the others', and the runs end failed; a replica
that Serve stops (a scale-down) ends its runs failed too, rather than leave them running for good.

A background stream (`stream: true` too) runs the same way, its events kept here as they come
(`EventLog`): the request that started it follows them, and a client that lost it picks them up
again with `GET /v1/responses/{id}?stream=true&starting_after=N` (OpenAI's), on this replica,
while the run goes on and after, for the last FINISHED_LOGS runs within FINISHED_LOG_BYTES.
Leaving the stream does not stop the run; a cancel ends the stream where the run stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

from router.engine_streams import collect, events
from router.errors import OpenAIError, bad_request, internal_error, overloaded
from router.formatting import Accumulator
from router.response_store import StoredResponses
from router.response_reply import ResponseReply
from router.responses import RUNNING

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 1.0  # how often a run reads its record, for a cancel or delete sent to another replica
FINISHED_LOGS = 64  # finished background streams whose events are kept for GET ?stream=true,
FINISHED_LOG_BYTES = 32 << 20  # at most this much of their events' text


class EventLog:
    """A background stream's events (SSE text; event k has sequence_number k), for its followers."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.num_bytes = 0
        self.done = False
        self._changed = asyncio.Condition()

    async def add(self, event: str) -> None:
        async with self._changed:
            self.events.append(event)
            self.num_bytes += len(event)
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.done = True
            self._changed.notify_all()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `starting_after`, then each as it comes, to the end."""
        i = max(starting_after + 1, 0)
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: i < len(self.events) or self.done)
                new = self.events[i:]
            if not new:
                return
            for event in new:
                yield event
            i += len(new)


class BackgroundRuns:
    """The background runs of this ingress replica, by response id; each has a token of its own
    (the record's "run"), so that a run's writes and polls take only its own record, never one
    that a later request under the same id made."""

    def __init__(self, stored: StoredResponses, poll_s: float = CANCEL_POLL_S) -> None:
        self.stored = stored
        self.poll_s = poll_s
        self._runs: dict[str, tuple[asyncio.Task, str]] = {}  # response id -> (its task, its run token)
        self._reserved = 0  # requests past the limit's check, not yet started (or refused)
        self._logs: OrderedDict[str, EventLog] = OrderedDict()  # background streams' events, oldest first

    def __len__(self) -> int:
        return len(self._runs) + self._reserved

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._runs

    @contextlib.contextmanager
    def reserved(self, limit: int, status: int = 503, retry_after_s: float = 1.0):
        """A place among at most `limit` runs here, held from the check (with no await between
        them, so requests that come together cannot all pass it) until the run starts or the
        request is refused; past the limit, `status` (the server's overload status)."""
        if limit == 0:
            raise bad_request("background responses are off on this server (--max-background-responses 0)",
                              "background")
        if len(self) >= limit:
            raise overloaded(retry_after_s, status, f"This server runs at most {limit} background responses at "
                                                    "once (--max-background-responses). Retry later.",
                             code="too_many_background_responses")
        self._reserved += 1
        try:
            yield
        finally:
            self._reserved -= 1

    def start(self, response_id: str, run: str, work: Coroutine, log: EventLog | None = None) -> None:
        """Runs `work` (which records its own end) until it returns or the record is no longer
        this run's; `log`: a background stream's, closed when the run ends."""
        task = asyncio.create_task(self._watched(response_id, run, work, log), name=f"background {response_id}")
        self._runs[response_id] = task, run
        task.add_done_callback(lambda t: self._runs.pop(response_id) if self._runs.get(response_id, (None,))[0] is t
                               else None)
        if log is not None:
            self._logs[response_id] = log
            self._logs.move_to_end(response_id)
            self._forget_finished()

    def _forget_finished(self) -> None:
        """The oldest finished logs go, past FINISHED_LOGS of them or FINISHED_LOG_BYTES."""
        finished = [rid for rid, kept in self._logs.items() if kept.done]
        size = sum(self._logs[rid].num_bytes for rid in finished)
        while finished and (len(finished) > FINISHED_LOGS or size > FINISHED_LOG_BYTES):
            size -= self._logs.pop(finished.pop(0)).num_bytes

    async def events(self, response_id: str, starting_after: int | None) -> AsyncIterator[str]:
        """`GET /v1/responses/{id}?stream=true`: a background stream's events after
        `starting_after` (all, without), as they come."""
        await self.stored.record(response_id)  # a 404 for one deleted, or never stored
        log = self._logs.get(response_id)
        if log is None:
            raise bad_request(f"The events of response '{response_id}' are not kept here: only a background "
                              "response created with stream true can be streamed again, from the ingress "
                              "replica that runs it, while it runs and for a while after", "stream")
        return log.follow(-1 if starting_after is None else starting_after)

    async def _watched(self, response_id: str, run: str, work: Coroutine, log: EventLog | None) -> None:
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait([task], timeout=self.poll_s)
                if not task.done() and not await self._still_running(response_id, run):
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except Exception:  # the run's own failure (its record fails when its lease runs out)
            logger.exception("background response %s failed", response_id)
        finally:  # cancelled here (a cancel sent to this replica): the run ends with it
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if log is not None:
                await log.close()

    async def _still_running(self, response_id: str, run: str) -> bool:
        """Whether the record is still this run's, running; asking renews the run's lease on it
        (router.response_store: a record whose run goes silent for RUN_LEASE_S is failed)."""
        try:
            return await self.stored.store.beat(response_id, run) in RUNNING
        except Exception:  # the store did not answer: the run goes on, and is asked again
            logger.warning("background response %s: its record could not be read", response_id, exc_info=True)
            return True

    async def stop(self, response_id: str) -> None:
        """Ends the run of `response_id` here, if there is one."""
        task, _ = self._runs.get(response_id, (None, None))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def delete(self, response_id: str) -> dict:
        """`DELETE /v1/responses/{id}`: a run here stops at once (elsewhere, at its next poll)."""
        await self.stop(response_id)
        return await self.stored.delete(response_id)

    async def shutdown(self) -> None:
        """This replica is stopping: its runs end, and their records say failed."""
        for response_id, (_, run) in list(self._runs.items()):
            await self.stop(response_id)
            with contextlib.suppress(Exception):  # gone from the store, or the store is stopping too
                record = await self.stored.record(response_id)
                if record.get("run") == run:
                    error = {"code": "server_shutdown", "message": "The server stopped before this background "
                                                                   "response finished. Create it again."}
                    failed = {**record["response"], "status": "failed", "error": error}
                    await self.stored.store.put(response_id, {**record, "response": failed}, run_update=True)

    async def cancel(self, response_id: str) -> dict:
        """`POST /v1/responses/{id}/cancel` (OpenAI's): the response, cancelled. Cancelling a
        cancelled one gives it again; a finished one, or one that did not run in the background,
        is a 400."""
        for _ in range(2):  # again where the run ended between the read and the write
            response = (await self.stored.record(response_id))["response"]
            if not response.get("background"):
                raise bad_request("Cannot cancel a synchronous response.", "response_id")
            if response["status"] == "cancelled":
                return response
            if response["status"] not in RUNNING:
                raise bad_request(f"Cannot cancel a response that is already {response['status']}.", "response_id")
            await self.stop(response_id)
            record = await self.stored.record(response_id)  # as the run left it
            cancelled = {**record["response"], "status": "cancelled"}
            if await self.stored.store.put(response_id, {**record, "response": cancelled}, run_update=True):
                return cancelled
        raise internal_error()


async def run_in_background(reply: ResponseReply, start: Callable[[], Awaitable[tuple]], acc: Accumulator) -> None:
    """A background response's run: `start()` sends it to the engine (router.serving's _send);
    its record goes in_progress with the first output, and ends as the reply does, or failed."""
    try:
        first, merged = await start()
        await reply.running()
        await collect(acc, first, merged)
        if not (await reply.whole(acc))["store"]:  # too large, or no longer running: kept only if still running
            await reply.failed(_too_large().body())
    except OpenAIError as e:
        await reply.failed(e.body())
    except Exception:
        logger.exception("background response %s failed", reply.id)
        await reply.failed(internal_error().body())


async def stream_in_background(reply: ResponseReply, start: Callable[[], Awaitable[tuple]], acc: Accumulator,
                               log: EventLog) -> None:
    """A background stream's run: as run_in_background, its events into `log` (the first two,
    response.created and response.queued, are there before it starts)."""
    try:
        first, merged = await start()
    except Exception as e:
        if not isinstance(e, OpenAIError):
            logger.exception("background response %s failed", reply.id)
        body = (e if isinstance(e, OpenAIError) else internal_error()).body()
        await log.add(reply.error_event(body))
        await log.add(reply.event("response.failed", response=await reply.failed(body)))
        return
    await log.add(reply.event("response.in_progress", response=await reply.running()))
    async with contextlib.aclosing(merged):
        async for event in reply.events(events(first, merged, acc, reply.error_event), acc, head=False):
            await log.add(event)
    await reply.failed(_too_large().body())  # only where the store could not keep the end: still running


def _too_large() -> OpenAIError:
    return OpenAIError(500, "The response is larger than this server's response store holds "
                            "(--responses-store-max-bytes).", type="server_error", code="response_too_large")


def check_id_free(runs: BackgroundRuns, record: dict | None, response_id: str) -> None:
    """A stored request may not take the id (vLLM's request_id) of a background response still running."""
    if response_id in runs or record is not None and record["response"]["status"] in RUNNING:
        raise OpenAIError(409, f"A response with id '{response_id}' is still running: cancel it, or give "
                               "another request_id", param="request_id", code="conflict")
