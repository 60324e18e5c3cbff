"""Background responses (router.background) through the official openai client, over a scripted
engine: `background: true` is answered queued at once, the stored record follows the run to its
end, `POST /v1/responses/{id}/cancel` stops it from any ingress replica (two apps sharing one
store stand for two replicas), and a delete stops it too. Nothing a run holds outlives it."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import openai
import pytest

from engine.config import EngineConfig
from router import background
from router.api import build_api
from router.response_store import ResponseStore
from router.serving import OpenAIServing
from router.settings import RouterSettings
from tests.scripted_engine import ScriptedEngine, run, served
from workers.server import EngineServer

REPLY = "Yes, the sky is blue."
LONG = "The sky is blue because air scatters blue light more than red light. " * 8  # ~50 steps


def create(client, **kwargs):
    return client.responses.create(model="m", input="Is the sky blue?", **{"background": True, **kwargs})


async def until_done(client, response_id: str, timeout_s: float = 10.0):
    """The response once it stops running (polled, as a client of background responses does)."""
    async with asyncio.timeout(timeout_s):
        while (r := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
            await asyncio.sleep(0.01)
    return r


def replicas(tokenizer, script: str, go, count: int = 2, poll_s: float = 0.05, store: ResponseStore | None = None,
             engine: ScriptedEngine | None = None, **engine_kwargs):
    """go(clients, servings) against `count` apps (ingress replicas) over one engine and one
    response store; -> (its result, the engine)."""
    engine = engine or ScriptedEngine(tokenizer, script, **engine_kwargs)
    server = EngineServer(EngineConfig(max_model_len=4096, max_num_seqs=4), lambda config: engine)
    store = store if store is not None else ResponseStore(1 << 20)  # (an empty one is falsy)
    servings = [OpenAIServing(tokenizer, server, RouterSettings(served_model_name="m"), store) for _ in range(count)]
    for serving in servings:
        serving.background.poll_s = poll_s

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            clients = []
            for serving in servings:
                http, base_url = await stack.enter_async_context(served(build_api(serving)))
                clients.append(openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", http_client=http,
                                                  max_retries=0))
            return await go(clients, servings)

    return asyncio.run(main()), engine


def test_a_background_response_is_queued_at_once_and_stored_when_done(tokenizer):
    async def go(client):
        queued = await create(client, instructions="Answer briefly.", max_output_tokens=40, metadata={"a": "b"})
        done = await until_done(client, queued.id)
        items = await client.responses.input_items.list(queued.id)
        follow = await client.responses.create(model="m", previous_response_id=queued.id, input="Why?")
        return queued, done, items, follow

    (queued, done, items, follow), engine = run(tokenizer, REPLY, go)
    assert queued.status == "queued" and queued.background and queued.store and queued.output == []
    assert queued.usage is None and queued.metadata == {"a": "b"} and queued.instructions == "Answer briefly."
    assert done.status == "completed" and done.output_text == REPLY and done.background and done.id == queued.id
    assert done.usage.output_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False))
    assert [i.content[0].text for i in items.data] == ["Is the sky blue?"]
    assert follow.status == "completed" and REPLY in tokenizer.decode(engine.seen[1][0])
    assert engine.seen[0][1].max_tokens == 40 and all(steps > 0 for steps in engine.ended.values())


def test_a_run_cut_at_max_output_tokens_or_failing_ends_so(tokenizer):
    async def go(client):
        return await until_done(client, (await create(client)).id)

    cut, _ = run(tokenizer, REPLY, go, finish_reason="length")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    failed, _ = run(tokenizer, REPLY, go, finish_reason="error", stop_reason="the grammar failed")
    assert failed.status == "failed" and failed.output == []
    assert failed.error.code == "invalid_grammar" and "the grammar failed" in failed.error.message


def test_cancel_stops_the_run_here_and_the_record_stays_cancelled(tokenizer):
    async def go(client):
        queued = await create(client)
        while (await client.responses.retrieve(queued.id)).status != "in_progress":
            await asyncio.sleep(0.01)
        cancelled = await client.responses.cancel(queued.id)
        again = await client.responses.cancel(queued.id)  # OpenAI's: cancelling twice gives it again
        await asyncio.sleep(0.3)  # long enough for the whole reply, had the run gone on
        return cancelled, again, await client.responses.retrieve(queued.id)

    (cancelled, again, later), engine = run(tokenizer, LONG, go, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert cancelled.status == again.status == later.status == "cancelled" and later.background
    ((rid, given),) = engine.ended.items()  # the engine's stream ended, cut short
    assert 0 < given < steps


def test_a_cancel_or_delete_sent_to_another_replica_stops_the_run(tokenizer):
    async def go(clients, servings):
        a, b = clients
        ids = [(await create(a)).id for _ in range(2)]
        await asyncio.sleep(0.1)
        assert len(servings[0].background) == 2 and len(servings[1].background) == 0
        cancelled = await b.responses.cancel(ids[0])
        await b.responses.delete(ids[1])
        async with asyncio.timeout(5):
            while len(servings[0].background):  # each run reads its record, and stops
                await asyncio.sleep(0.01)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(ids[1])
        return cancelled, await a.responses.retrieve(ids[0])

    (cancelled, later), engine = replicas(tokenizer, LONG, go, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert cancelled.status == later.status == "cancelled"
    assert len(engine.ended) == 2 and all(0 < given < steps for given in engine.ended.values())


@pytest.mark.parametrize("background", [False, True])
def test_only_a_running_background_response_can_be_cancelled(tokenizer, background):
    async def go(client):
        r = await create(client, background=background)
        if background:
            await until_done(client, r.id)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.cancel(r.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel("resp_unknown")
        return e.value.body

    error, _ = run(tokenizer, REPLY, go)
    says = "Cannot cancel a response that is already completed." if background else \
        "Cannot cancel a synchronous response."
    assert error["message"] == says and error["param"] == "response_id"


def test_a_running_response_cannot_be_continued_nor_its_id_taken(tokenizer):
    async def go(client):
        queued = await create(client, extra_body={"request_id": "resp_mine"})
        with pytest.raises(openai.BadRequestError) as follow:
            await client.responses.create(model="m", previous_response_id=queued.id, input="Why?")
        with pytest.raises(openai.ConflictError) as taken:
            await create(client, background=False, extra_body={"request_id": "resp_mine"})
        await client.responses.cancel(queued.id)
        return follow.value.body, taken.value.body

    (follow, taken), _ = run(tokenizer, LONG, go, step_s=0.02)
    assert follow["param"] == "previous_response_id" and "has not finished" in follow["message"]
    assert taken["param"] == "request_id" and "still running" in taken["message"]


@pytest.mark.parametrize("kwargs, settings, param, says", [
    ({"store": False}, {}, "background", "background can only be used when `store` is true"),
    ({}, {"responses_store_max_bytes": 0}, "background", "needs the response store"),
    ({}, {"max_background_responses": 0}, "background", "off on this server"),
    ({"max_output_tokens": 5000}, {}, "max_output_tokens", ""),  # checked now, not a failed run later
])
def test_what_a_background_run_cannot_do_is_a_400_at_once(tokenizer, kwargs, settings, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, REPLY, lambda client: create(client, **kwargs), settings=settings)
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


# -- background streams ----------------------------------------------------------------------------

def test_a_background_stream_starts_queued_and_is_stored_at_its_end(tokenizer):
    async def go(client):
        stream = await create(client, stream=True)
        events = [e async for e in stream]
        return events, await client.responses.retrieve(events[0].response.id)

    (events, stored), _ = run(tokenizer, REPLY, go)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == events[1].response.status == "queued"
    assert events[2].response.status == "in_progress"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert stored.status == "completed" and stored.output_text == REPLY and stored.background
    assert stored.model_dump() == events[-1].response.model_dump()


def test_a_client_that_left_a_background_stream_picks_it_up_where_it_left(tokenizer):
    async def go(client):
        stream = await create(client, stream=True)
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 6:
                break
        await stream.close()  # the client goes; the run goes on
        rest = [e async for e in await client.responses.retrieve(seen[0].response.id, stream=True,
                                                                   starting_after=seen[-1].sequence_number)]
        again = [e async for e in await client.responses.retrieve(seen[0].response.id, stream=True)]
        return seen, rest, again

    (seen, rest, again), engine = run(tokenizer, LONG, go, live=True, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events))) and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == LONG
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]  # from the start, whole
    assert list(engine.ended.values()) == [steps]


def test_a_cancel_ends_a_background_stream_and_only_those_are_streamed_again(tokenizer):
    async def go(client):
        stream = await create(client, stream=True)
        seen, cancelled = [], None
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and not cancelled:
                cancelled = await client.responses.cancel(seen[0].response.id)
        whole = await create(client, background=False)
        errors = []
        for rid, error in ((whole.id, openai.BadRequestError), ("resp_unknown", openai.NotFoundError)):
            with pytest.raises(error) as e:
                await client.responses.retrieve(rid, stream=True)
            errors.append(e.value.body)
        return seen, errors, await client.responses.retrieve(seen[0].response.id)

    (seen, errors, stored), engine = run(tokenizer, LONG, go, live=True, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert seen[-1].type == "response.output_text.delta" and stored.status == "cancelled"  # the stream just ends
    assert 0 < list(engine.ended.values())[0] < steps
    assert errors[0]["param"] == "stream" and "not kept here" in errors[0]["message"]
    assert "not found" in errors[1]["message"]


@pytest.mark.parametrize("limits", [{"FINISHED_LOGS": 1}, {"FINISHED_LOG_BYTES": 1}])
def test_the_oldest_finished_streams_events_go_past_the_limits(tokenizer, monkeypatch, limits):
    for name, value in limits.items():
        monkeypatch.setattr(background, name, value)

    async def go(client):
        ids = []
        for _ in range(3):
            ids.append([e async for e in await create(client, stream=True)][0].response.id)
            await asyncio.sleep(0.05)  # its run has ended
        kept = []
        for rid in ids:
            try:
                kept.append(len([e async for e in await client.responses.retrieve(rid, stream=True)]) > 0)
            except openai.BadRequestError:
                kept.append(False)
        return kept

    kept, _ = run(tokenizer, REPLY, go)
    assert kept == ([False, True, True] if "FINISHED_LOGS" in limits else [False, False, True])


def test_a_replica_that_stops_ends_its_runs_failed(tokenizer):
    """What the ingress does when Serve stops it (its __del__): no record stays running for good."""
    async def go(clients, servings):
        a, b = clients
        queued = await create(a)
        while (await b.responses.retrieve(queued.id)).status != "in_progress":
            await asyncio.sleep(0.01)
        await servings[0].background.shutdown()
        return len(servings[0].background), await b.responses.retrieve(queued.id)

    (running, stopped), engine = replicas(tokenizer, LONG, go, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert running == 0 and stopped.status == "failed" and stopped.error.code == "server_shutdown"
    assert 0 < list(engine.ended.values())[0] < steps


# -- what a review of the above found --------------------------------------------------------------

class _FailingEngine(ScriptedEngine):
    """Its calls fail with an error of its own (not an OpenAIError), as an engine's bug would."""

    async def generate(self, request_id, prompt, params):
        raise RuntimeError("an engine bug")
        yield


@pytest.mark.parametrize("stream", [False, True])
def test_a_run_whose_engine_call_fails_ends_failed(tokenizer, stream):
    async def go(clients, servings):
        (client,) = clients
        if stream:
            events = [e async for e in await create(client, stream=True)]
            return [e.type for e in events], await client.responses.retrieve(events[0].response.id)
        return None, await until_done(client, (await create(client)).id)

    (kinds, stored), _ = replicas(tokenizer, REPLY, go, count=1, engine=_FailingEngine(tokenizer, REPLY))
    assert stored.status == "failed" and stored.error.code == "internal_error"
    assert kinds in (None, ["response.created", "response.queued", "error", "response.failed"])


class _SlowStore(ResponseStore):
    """A store each call of which waits, as one in another process does (more than one ingress replica)."""

    async def get(self, response_id):
        await asyncio.sleep(0.002)
        return await super().get(response_id)

    async def put(self, response_id, record, run_update=False):
        await asyncio.sleep(0.002)
        return await super().put(response_id, record, run_update)


def test_requests_racing_for_one_id_start_one_run(tokenizer):
    async def go(clients, servings):
        tries = [create(client, extra_body={"request_id": "resp_one"}) for client in clients for _ in range(3)]
        got = await asyncio.gather(*tries, return_exceptions=True)
        await asyncio.sleep(0.05)
        running = sum(len(serving.background) for serving in servings)
        await clients[0].responses.cancel("resp_one")
        return got, running

    (got, running), engine = replicas(tokenizer, LONG, go, store=_SlowStore(1 << 20), step_s=0.02)
    assert sum(isinstance(r, openai.ConflictError) for r in got) == 5 and running == 1 and len(engine.seen) == 1


def test_a_delete_stops_the_run_here_at_once(tokenizer):
    async def go(clients, servings):
        (client,) = clients
        queued = await create(client)
        while (await client.responses.retrieve(queued.id)).status != "in_progress":
            await asyncio.sleep(0.01)
        await client.responses.delete(queued.id)
        return len(servings[0].background)

    running, engine = replicas(tokenizer, LONG, go, count=1, poll_s=1.0, step_s=0.02)  # a poll would come late
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert running == 0 and 0 < list(engine.ended.values())[0] < steps


def test_a_run_whose_replica_died_is_failed_once_its_lease_runs_out(tokenizer):
    async def go(clients, servings):
        a, b = clients
        died, lives = (await create(a)).id, (await create(a)).id
        await asyncio.sleep(0.1)
        servings[0].background._runs.pop(died)[0].cancel()  # ended without a word, as a dead process's
        await asyncio.sleep(0.5)  # past the lease; the live run's polls renew its own
        return await b.responses.retrieve(died), await until_done(b, lives)

    (died, lives), _ = replicas(tokenizer, LONG, go, store=ResponseStore(1 << 20, lease_s=0.3), step_s=0.01)
    assert died.status == "failed" and "stopped before it finished" in died.error.message
    assert lives.status == "completed" and lives.output_text == LONG


def test_background_runs_past_the_limit_are_refused_and_a_run_waits_for_room(tokenizer, monkeypatch):
    admitted = []
    generate = EngineServer.generate

    def spy(self, request_id, prompt_token_ids, params, admitted_=False, **kwargs):
        admitted.append(kwargs.get("admitted", admitted_))
        return generate(self, request_id, prompt_token_ids, params)

    monkeypatch.setattr(EngineServer, "generate", spy)

    async def go(client):
        first = await create(client)
        with pytest.raises(openai.APIStatusError) as e:
            await create(client)
        await client.responses.cancel(first.id)
        await create(client, background=False)
        return e.value

    refused, _ = run(tokenizer, LONG, go, settings={"max_background_responses": 1}, step_s=0.02)
    assert refused.status_code == 503 and refused.body["code"] == "too_many_background_responses"
    assert "Retry-After" in refused.response.headers
    assert admitted == [True, False]  # the run's call waits for room in a full queue; a request's is refused


def test_a_cancelled_run_does_not_take_the_record_of_a_request_that_reuses_its_id(tokenizer):
    """A later request under a cancelled run's id (before that run's next poll, on another
    replica) makes a record of its own run: the old run's writes and polls no longer take it."""
    async def go(clients, servings):
        a, b = clients
        await create(a, extra_body={"request_id": "resp_x"}, metadata={"run": "old"})
        await asyncio.sleep(0.1)
        await b.responses.cancel("resp_x")
        await create(b, extra_body={"request_id": "resp_x"}, metadata={"run": "new"})
        return await until_done(b, "resp_x")

    final, engine = replicas(tokenizer, LONG, go, poll_s=0.5, step_s=0.02)
    steps = -(-len(tokenizer.encode(LONG, add_special_tokens=False)) // 3)
    assert final.status == "completed" and final.metadata == {"run": "new"} and final.output_text == LONG
    assert sorted(engine.ended.values())[0] < steps  # the old run stopped at its next poll


def test_requests_that_come_together_cannot_pass_the_limit_together(tokenizer):
    async def go(clients, servings):
        (client,) = clients
        servings[0].settings = dataclasses.replace(servings[0].settings, max_background_responses=1)
        got = await asyncio.gather(*(create(client) for _ in range(4)), return_exceptions=True)
        running = len(servings[0].background)
        for r in got:
            if not isinstance(r, Exception):
                await client.responses.cancel(r.id)
        return got, running

    (got, running), _ = replicas(tokenizer, LONG, go, count=1, store=_SlowStore(1 << 20), step_s=0.02)
    assert running == 1 and sum(isinstance(r, openai.InternalServerError) for r in got) == 3
