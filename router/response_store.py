"""Stored responses of the Responses API (`store: true`, OpenAI's default), for
`previous_response_id`, `GET /v1/responses/{id}`, its `/input_items` and `DELETE`.

A record is one response's JSON: the response object, its input items, and the conversation
through it (every input and output item of the chain, instructions aside, as OpenAI carries
them) so that a follow-up reads one record, however long the chain. Records live in memory,
newest used last, and the least recently used go once their total size passes `max_bytes`; a
chain is at most `max_model_len` tokens, so each record is too. Nothing survives a restart of
the process that holds them: the ingress when there is one ingress replica, else one
`ResponseStoreDeployment` replica that every ingress replica asks (router.ingress).
"""
from __future__ import annotations

import json
from collections import OrderedDict


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._records: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (JSON, bytes), LRU first

    def __len__(self) -> int:
        return len(self._records)

    async def put(self, response_id: str, record: dict) -> bool:
        """Stores `record` under `response_id` (newest); False when it alone is over max_bytes."""
        text = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        size = len(text.encode())
        if size > self.max_bytes:
            return False
        await self.delete(response_id)
        self._records[response_id] = text, size
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, old) = self._records.popitem(last=False)
            self.num_bytes -= old
        return True

    async def get(self, response_id: str) -> dict | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        self._records.move_to_end(response_id)
        return json.loads(entry[0])

    async def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True
