"""What changed at each replica, as far as the router knows, since that replica's last stats report.

Stats arrive every few hundred milliseconds; a burst arrives in microseconds. Without this
ledger every request of a burst would see the same snapshot and land on the same "best" replica.
Each dispatch is recorded with its KV footprint, its new prefill tokens and its prompt's prefix
hashes (which that replica will hold once it admits the request, so followers of the same prefix
are sent after it). A completion is recorded as a negative entry: the request's seat and blocks
are free again (Serve tells its router through `on_request_completed`), and if no report has
covered its dispatch yet, its prompt no longer waits to be prefilled (once one has, the prompt
is in the queue that report showed, or done). A completion also books the prompt's partial last
block, by its parent hash and tokens: the answer has filled that block and the replica caches
it, but the router never sees the answer, so until the next report it would not know that the
chat's next turn (prompt + answer + new message) finds one block more there than anywhere else.
A report taken after an entry covers it, and the entry is dropped:

    entries  +t1  +t2  -t3  +t4          report(timestamp=T, t2 <= T < t3)
    ledger   [+t1, +t2, -t3, +t4]  -->  [-t3, +t4]

So the totals are the net change since the report: they can be negative.

Entries older than `expire_after_s` are dropped too, so a replica that never reports (or died)
does not keep a growing ledger.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class Pending:
    """Net change at one replica, by the router's own count, since its last stats report."""
    num_requests: int = 0  # dispatched - completed
    num_blocks: int = 0  # KV footprint (prompt + max_tokens, less expected prefix hits), dispatched - freed
    num_prefill_tokens: int = 0  # prompt tokens the replica will have to compute
    prefix_hashes: Counter = field(default_factory=Counter)  # hash -> dispatches holding it
    tails: Counter = field(default_factory=Counter)  # (parent hash, tokens) of completed prompts' last blocks
    tail_parents: Counter = field(default_factory=Counter)  # their parent hashes (one lookup rules most out)

    def __contains__(self, h: int) -> bool:
        return h in self.prefix_hashes


EMPTY = Pending()

Tail = tuple[int, tuple[int, ...]]  # (parent hash, token ids) of a prompt's partial last block


@dataclass(frozen=True)
class Booking:
    """What a dispatch at `time` booked at its replica: its KV footprint in blocks, the prompt
    tokens the replica has to compute, and the tail its completion will leave there (None when
    the prompt ends on a block boundary)."""
    time: float
    num_blocks: int
    num_prefill_tokens: int = 0
    tail: Tail | None = None


@dataclass(frozen=True)
class _Entry:
    time: float
    num_requests: int  # +1 dispatch, -1 completion
    num_blocks: int
    num_prefill_tokens: int
    prefix_hashes: tuple[int, ...]
    tail: Tail | None = None


class PendingLedger:
    def __init__(self, expire_after_s: float = 10.0) -> None:
        self.expire_after_s = expire_after_s
        self._log: dict[str, deque[_Entry]] = {}
        self._totals: dict[str, Pending] = {}

    def record(self, replica_id: str, now: float, num_blocks: int, num_prefill_tokens: int,
               prefix_hashes: tuple[int, ...] | list[int] = ()) -> None:
        self._add(replica_id, _Entry(now, 1, num_blocks, num_prefill_tokens, tuple(prefix_hashes)))

    def release(self, replica_id: str, now: float, booking: Booking) -> None:
        """A request dispatched there with this booking has completed (or was aborted)."""
        log = self._log.get(replica_id)
        booked = log and log[0].time <= booking.time  # its dispatch is still here (entries go in time order)
        prefill = booking.num_prefill_tokens if booked else 0
        self._add(replica_id, _Entry(now, -1, -booking.num_blocks, -prefill, (), booking.tail))

    def _add(self, replica_id: str, d: _Entry) -> None:
        self._log.setdefault(replica_id, deque()).append(d)
        p = self._totals.setdefault(replica_id, Pending())
        p.num_requests += d.num_requests
        p.num_blocks += d.num_blocks
        p.num_prefill_tokens += d.num_prefill_tokens
        p.prefix_hashes.update(d.prefix_hashes)
        if d.tail is not None:
            p.tails[d.tail] += 1
            p.tail_parents[d.tail[0]] += 1

    def covered(self, replica_id: str, report_time: float) -> None:
        """A report taken at `report_time` already reflects the dispatches made before it."""
        self._drop(replica_id, lambda d: d.time <= report_time)

    def expire(self, now: float) -> None:
        for rid in list(self._log):
            self._drop(rid, lambda d: now - d.time > self.expire_after_s)

    def forget(self, replica_id: str) -> None:
        self._log.pop(replica_id, None)
        self._totals.pop(replica_id, None)

    def get(self, replica_id: str) -> Pending:
        return self._totals.get(replica_id, EMPTY)

    def view(self) -> dict[str, Pending]:
        return self._totals

    def _drop(self, replica_id: str, is_done) -> None:
        log, p = self._log.get(replica_id), self._totals.get(replica_id)
        while log and is_done(log[0]):
            d = log.popleft()
            p.num_requests -= d.num_requests
            p.num_blocks -= d.num_blocks
            p.num_prefill_tokens -= d.num_prefill_tokens
            for h in d.prefix_hashes:
                _discount(p.prefix_hashes, h)
            if d.tail is not None:
                _discount(p.tails, d.tail)
                _discount(p.tail_parents, d.tail[0])
        if log is not None and not log:
            self.forget(replica_id)


def _discount(counter: Counter, key) -> None:
    """One holder of `key` less; the key goes when none is left (membership means held)."""
    if counter[key] <= 1:
        del counter[key]
    else:
        counter[key] -= 1
