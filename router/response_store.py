"""Stored responses of the Responses API (`store: true`, OpenAI's default), for
`previous_response_id`, `GET /v1/responses/{id}`, its `/input_items`, `DELETE` and (a
background one's) `/cancel`.

`ResponseStore` keeps them; `StoredResponses` is what the API does with them. A record is one
response's JSON: the response object, its input items, and the conversation
through it (every input and output item of the chain, instructions aside, as OpenAI carries
them) so that a follow-up reads one record, however long the chain. Records live in memory,
newest used last, and the least recently used go once their total size passes `max_bytes`; a
chain is at most `max_model_len` tokens, so each record is too. Nothing survives a restart of
the process that holds them: the ingress when there is one ingress replica, else one
`ResponseStoreDeployment` replica that every ingress replica asks (router.ingress).
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.errors import OpenAIError, bad_request
from router.responses import RUNNING, ResponsesRequest, item_dicts


RUN_LEASE_S = 30.0  # a running record whose run was not heard of for this long is failed: its replica is gone
_LOST = {"code": "server_error", "message": "The server running this background response stopped before it "
                                           "finished. Create it again."}


@dataclass
class _Entry:
    text: str  # the record's JSON
    size: int  # its bytes
    status: str  # its response's
    run: str | None  # a background response's run (the record's "run"), whose writes and polls it takes
    beat_at: float  # time.monotonic() of the last word from that run


class ResponseStore:
    def __init__(self, max_bytes: int, lease_s: float = RUN_LEASE_S) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.lease_s = lease_s
        self.num_bytes = 0
        self._records: OrderedDict[str, _Entry] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._records)

    async def put(self, response_id: str, record: dict, run_update: bool = False) -> bool:
        """Stores `record` under `response_id` (newest); False when it alone is over max_bytes,
        and where it would change who holds the id: a running background response's record is
        replaced only by its run's (`run_update`, with the record's "run": its progress, its end,
        a cancel of it), and a run's replaces nothing else (its record was cancelled, deleted,
        evicted, or taken by another run since, which a run never undoes). Atomic here, in the
        one process that holds the store."""
        entry = self._current(response_id)
        running = entry is not None and entry.status in RUNNING
        if running != run_update or run_update and entry.run != record.get("run"):
            return False
        return self._write(response_id, record)

    async def get(self, response_id: str) -> dict | None:
        entry = self._current(response_id)
        if entry is None:
            return None
        self._records.move_to_end(response_id)
        return json.loads(entry.text)

    async def beat(self, response_id: str, run: str) -> str | None:
        """A background run's word that it goes on (router.background, every poll) -> its
        record's status; None: the record is gone, or another run's."""
        entry = self._current(response_id)
        if entry is None or entry.run != run:
            return None
        entry.beat_at = time.monotonic()
        return entry.status

    async def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size
        return True

    def _write(self, response_id: str, record: dict) -> bool:
        text = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        size = len(text.encode())
        if size > self.max_bytes:
            return False
        old = self._records.pop(response_id, None)
        self.num_bytes -= old.size if old is not None else 0
        self._records[response_id] = _Entry(text, size, record["response"]["status"], record.get("run"),
                                            time.monotonic())
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, gone = self._records.popitem(last=False)
            self.num_bytes -= gone.size
        return True

    def _current(self, response_id: str) -> _Entry | None:
        """The id's entry; a running one whose run went silent past the lease is failed first
        (its ingress replica died: nothing else would ever end it)."""
        entry = self._records.get(response_id)
        if entry is not None and entry.status in RUNNING and time.monotonic() - entry.beat_at > self.lease_s:
            record = json.loads(entry.text)
            record["response"] = {**record["response"], "status": "failed", "error": _LOST}
            self._write(response_id, record)
            entry = self._records.get(response_id)
        return entry


class StoredResponses:
    """The Responses API's use of a store (any object with ResponseStore's async put / get /
    beat / delete; None: the store is off, nothing is kept)."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    def keeper(self, req: ResponsesRequest, history: list[dict],
               run: str | None = None) -> Callable[[dict], Awaitable[bool]] | None:
        """What stores the request's finished response, or None when it is not to be stored;
        `run`: a background request's run, which its records name."""
        if self.store is None or not req.store:
            return None
        inputs = item_dicts(req.input)

        async def keep(response: dict) -> bool:
            record = {"response": response, "input": inputs, "conversation": history + inputs + response["output"],
                      "run": run}
            # a background run's later records replace only its running one (router.background)
            return await self.store.put(response["id"], record,
                                        run_update=req.background and response["status"] != "queued")
        return keep

    async def conversation(self, previous_response_id: str | None) -> list[dict]:
        """The items of the conversation through `previous_response_id` (none without one)."""
        if previous_response_id is None:
            return []
        if self.store is None:
            raise bad_request("previous_response_id needs the response store, which is off on this server "
                              "(--responses-store-max-bytes 0)", "previous_response_id")
        record = await self.store.get(previous_response_id)
        if record is None:
            raise OpenAIError(400, f"Previous response with id '{previous_response_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
        if (status := record["response"]["status"]) in RUNNING:
            raise bad_request(f"Previous response with id '{previous_response_id}' has not finished (it is "
                              f"{status}): wait for it to complete, or cancel it", "previous_response_id")
        return record["conversation"]

    async def retrieve(self, response_id: str) -> dict:
        """`GET /v1/responses/{id}`: a stored response as it was returned."""
        return (await self.record(response_id))["response"]

    async def delete(self, response_id: str) -> dict:
        if self.store is None or not await self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(self, response_id: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> dict:
        """`GET /v1/responses/{id}/input_items`: the request's input items, a page of them
        (`limit`, after the item `after`), newest first unless `order` is asc (as OpenAI's)."""
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", "limit")
        items = (await self.record(response_id))["input"]
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"no input item with id '{after}' in this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def record(self, response_id: str) -> dict:
        record = await self.store.get(response_id) if self.store is not None else None
        if record is None:
            raise _not_found(response_id)
        return record


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")
