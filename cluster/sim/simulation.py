"""Discrete-event simulation of a router in front of N engine replicas.

    events (heap by time)   arrival -> router.submit -> replica.add
                            step_done(r) -> replica.complete -> metrics; next step of r
                            report(r) every stats_interval_s (phases staggered) -> router's view

The router sees the replicas as Serve's router would: KV stats only from reports (stale by up to
one interval, plus whatever the policy's pending ledger adds since), and live queue lengths (Serve
probes them) for the other policies. A request no replica can take waits in the router's bounded
queue and is retried when the view changes; when that queue is full it is rejected (a 503/429 in
Serve). Which held request goes first:

    kv      room opening on replica r goes to `cluster.policy.choose_held`'s pick for r (most
            prefix resident on r, the oldest once it has waited max_hold_s); held_order=fifo:
            strictly oldest first
    others  as Serve's router: each of the oldest `routing_tasks` held requests asks its policy
            again, oldest first, and whichever finds an open replica takes it

A multi-turn follow-up arrives its think time after the previous turn finished (a rejected turn
ends its session). Model time comes from the cost model; CPU time is the scheduler's and block
manager's.
"""
from __future__ import annotations

import heapq
import itertools
import random
import sys
from collections import defaultdict, deque
from dataclasses import dataclass

from cluster.pending import PendingLedger
from cluster.policy import KVPolicyConfig, RouteRequest, choose_held, make_router, record_dispatch
from cluster.sim.cost import CostModel
from cluster.sim.metrics import RequestRecord, SimResult, summarize
from cluster.sim.replica import ReplicaConfig, SimReplica, default_token
from cluster.sim.workload import RequestSpec, detokenize
from cluster.stats import DEFAULT_PREFIX_LIMIT, ReplicaStats
from engine.scheduler import ScheduledBatch

ARRIVAL, STEP_DONE, REPORT = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 8
    replica: ReplicaConfig = ReplicaConfig()
    cost: CostModel = CostModel()
    stats_interval_s: float = 0.5  # how often each replica reports (Serve: request_routing_stats_period_s)
    prefix_limit: int = DEFAULT_PREFIX_LIMIT
    max_queue: int = 1_000_000  # requests held at the router before rejecting
    # Requests in flight per replica before the router holds them: default max_num_seqs (as
    # cluster.app deploys) for pow2 and round_robin, no limit for the peers whose authors deploy
    # them so (`queues_at_replica`: the engine queues); kv keeps its own seat count.
    max_ongoing: int | None = None
    warmup_s: float = 0.0  # requests arriving earlier are not measured
    drain_limit_s: float = 300.0  # stop this long after the last arrival even if work remains
    kv: KVPolicyConfig = KVPolicyConfig()
    ttft_slo_s: float = 2.0  # goodput: requests whose first token came within this
    seed: int = 0
    # Every replica starts with every shared prefix of the workload in its prefix cache (system
    # prompts, group prefixes): a world no router can make for free, which shows what routing could
    # reach if no request ever met a cold prefix.
    prewarm: bool = False

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.stats_interval_s <= 0 or self.max_queue < 1 or self.ttft_slo_s <= 0:
            raise ValueError("num_replicas and max_queue must be >= 1, stats_interval_s and ttft_slo_s > 0")

    @property
    def routing_tasks(self) -> int:
        """Held requests Serve's router works on at once (RequestRouter.max_num_routing_tasks)."""
        return min(50, 2 * self.num_replicas)


@dataclass
class _Held:
    spec: RequestSpec
    request: RouteRequest
    prompt: list[int]
    arrival: float


class Simulation:
    def __init__(self, config: SimConfig, policy: str, progress: bool = False) -> None:
        self.config, self.policy, self.progress = config, policy, progress
        self.now = 0.0
        self._events: list = []  # heap of (time, tie, kind, payload)
        self._tie = itertools.count()
        cfg = config
        self.router = make_router(self.policy, seed=cfg.seed, kv_config=cfg.kv)
        self.replicas = {f"r{i}": SimReplica(f"r{i}", cfg.replica, self._token) for i in range(cfg.num_replicas)}
        self.stats: dict[str, ReplicaStats | None] = dict.fromkeys(self.replicas)
        self.queue_lens = dict.fromkeys(self.replicas, 0)
        self.ledger = PendingLedger(expire_after_s=max(10.0, 4 * cfg.stats_interval_s))
        self.held: deque[_Held] = deque()
        self.records: dict[str, RequestRecord] = {}
        self.inflight: dict[str, tuple[ScheduledBatch, float]] = {}  # replica -> its running step and its duration
        uncapped = getattr(self.router, "queues_at_replica", False)
        self.max_ongoing = cfg.max_ongoing or (None if uncapped else cfg.replica.max_num_seqs)
        self.rejected = 0
        self.max_held = 0
        self.outputs: dict[str, list[int]] = {}  # fixed answers (multi-turn), by request id
        self.followups: dict[str, list[RequestSpec]] = defaultdict(list)  # request id -> its next turn
        self.arrivals_due = 0  # arrival events in the heap (a session between turns is not idle)
        rng = random.Random(cfg.seed)
        for rid in self.replicas:  # staggered report phases, first report at once
            self._push(rng.uniform(0, cfg.stats_interval_s), REPORT, rid)
            self.stats[rid] = self.replicas[rid].report(0.0, cfg.prefix_limit)

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (t, next(self._tie), kind, payload))

    # -- routing ------------------------------------------------------------------------------------
    def _token(self, seq) -> int:
        out = self.outputs.get(seq.request_id)
        return out[seq.num_output_tokens] if out is not None else default_token(seq)

    def _try_route(self, h: _Held, only: str | None = None) -> bool:
        stats = self.stats if only is None else {only: self.stats[only]}
        rid = self.router.choose(h.request, stats, self.ledger.view(), self.now, self.queue_lens, self.max_ongoing)
        if rid is None:
            return False
        rec = self.records[h.spec.request_id]
        rec.booking = record_dispatch(self.ledger, rid, h.request, self.stats, self.now,
                                      self.config.replica.block_size)
        self.router.routed(h.request, rid, self.now)
        rec.dispatch, rec.replica = self.now, rid
        self.replicas[rid].add(h.spec.request_id, h.prompt, h.spec.max_tokens)
        self.queue_lens[rid] += 1
        if rid not in self.inflight:
            self._start_step(rid)
        return True

    def _drain(self, changed: str) -> None:
        """Retry held requests after `changed`'s view changed. Every held request already failed
        on every replica and only `changed` moved, so kv (deterministic) retries on it alone: the
        same decision as a full scan at 1/N of the cost."""
        if self.policy != "kv":
            self._drain_serve()
        elif self.config.kv.held_order == "fifo":
            only = changed
            while self.held and self._try_route(self.held[0], only):
                self.held.popleft()
                only = None  # the new head has not been tried yet
        else:
            self._drain_affinity(changed)

    def _drain_affinity(self, rid: str) -> None:
        while self.held and self.stats[rid] is not None:
            window = [(h.arrival, h.request) for h in itertools.islice(self.held, self.config.kv.held_window)]
            i = choose_held(window, rid, self.stats[rid], self.ledger.get(rid), self.now, self.config.kv)
            if i is None or not self._try_route(self.held[i], rid):
                return
            del self.held[i]

    def _drain_serve(self) -> None:
        """Serve's router: the oldest `routing_tasks` held requests each ask their policy again."""
        i = tried = 0
        while i < len(self.held) and tried < self.config.routing_tasks:
            tried += 1
            if self._try_route(self.held[i]):
                del self.held[i]
            else:
                i += 1

    def _may_route_now(self) -> bool:
        """Whether a new arrival asks its policy at once, or queues behind the held requests."""
        if not self.held:
            return True
        if self.policy != "kv":
            return len(self.held) < self.config.routing_tasks  # it gets a routing task of its own
        kv = self.config.kv
        # affinity: held requests fit nowhere now, so a newcomer that fits may go, unless the oldest is overdue
        return kv.held_order == "affinity" and self.now - self.held[0].arrival < kv.max_hold_s

    def _on_arrival(self, spec: RequestSpec) -> None:
        self.arrivals_due -= 1
        prompt = spec.prompt()
        if spec.fixed_output:
            self.outputs[spec.request_id] = spec.output()
        self.records[spec.request_id] = RequestRecord(spec.request_id, self.now, spec.group, len(prompt),
                                                      spec.max_tokens)
        request = RouteRequest(prompt, spec.max_tokens, session=spec.session, detokenize=detokenize)
        h = _Held(spec, request, prompt, self.now)
        rc = self.config.replica
        if (len(prompt) + spec.max_tokens > rc.max_model_len
                or h.request.footprint_blocks(rc.block_size) > rc.num_blocks):
            self._reject(spec)  # the engine's validate() answers 400
            return
        if not self._may_route_now() or not self._try_route(h):
            if len(self.held) >= self.config.max_queue:
                self._reject(spec)
                return
            self.held.append(h)
            self.max_held = max(self.max_held, len(self.held))

    def _reject(self, spec: RequestSpec) -> None:
        self.records[spec.request_id].rejected = True
        self.rejected += 1
        self.followups.pop(spec.request_id, None)  # the session ends

    # -- replicas -------------------------------------------------------------------------------------
    def _start_step(self, rid: str) -> None:
        rep = self.replicas[rid]
        batch = rep.schedule()
        if not batch.seqs:  # nothing schedulable (cannot happen with work queued and an empty pool)
            return
        seconds = self.config.cost.batch_time(batch)
        self.inflight[rid] = (batch, seconds)
        self._push(self.now + seconds, STEP_DONE, rid)

    def _on_step_done(self, rid: str) -> None:
        rep, (batch, seconds) = self.replicas[rid], self.inflight.pop(rid)
        res = rep.complete(batch, seconds)
        for seq in res.first_token:
            self.records[seq.request_id].first_token = self.now
        for seq in res.finished:
            rec = self.records[seq.request_id]
            rec.finish, rec.num_output_tokens = self.now, seq.num_output_tokens
            rec.num_cached_tokens, rec.num_preemptions = seq.num_cached_tokens, seq.num_preemptions
            self.ledger.release(rid, self.now, rec.booking)  # Serve: RequestRouter.on_request_completed
            self.outputs.pop(seq.request_id, None)
            for nxt in self.followups.pop(seq.request_id, ()):
                self._push(self.now + nxt.arrival, ARRIVAL, nxt)
                self.arrivals_due += 1
        self.queue_lens[rid] -= len(res.finished)
        if rep.has_work():
            self._start_step(rid)
        if res.finished and self.held:
            self._drain(rid)  # live queue lengths and the ledger just changed

    def _on_report(self, rid: str) -> None:
        self.stats[rid] = self.replicas[rid].report(self.now, self.config.prefix_limit)
        self.ledger.covered(rid, self.now)
        self._push(self.now + self.config.stats_interval_s, REPORT, rid)
        if self.held:
            self._drain(rid)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, workload: list[RequestSpec]) -> SimResult:
        if self.config.prewarm:
            self._prewarm(workload)
        for spec in workload:
            if spec.context is None:
                self._push(spec.arrival, ARRIVAL, spec)
                self.arrivals_due += 1
            else:
                self.followups[spec.context.request_id].append(spec)
        last_arrival = max((s.arrival for s in workload if s.context is None), default=0.0)
        end = last_arrival + self.config.drain_limit_s
        handlers = {ARRIVAL: self._on_arrival, STEP_DONE: self._on_step_done, REPORT: self._on_report}
        next_progress, n_events = 0.0, 0
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if t > end or (t > last_arrival and self._idle()):
                break
            self.now = t
            handlers[kind](payload)
            n_events += 1
            if self.progress and t >= next_progress:
                self._show_progress(t, last_arrival)
                next_progress = t + max(1.0, last_arrival / 20)
        if self.progress:
            sys.stderr.write("\n")
        return summarize(self.policy, self.config, list(self.records.values()), self.replicas.values(),
                         self.now, self.rejected, self.max_held, n_events)

    def _prewarm(self, workload: list[RequestSpec]) -> None:
        prefixes = {id(s.prefix): s.prefix for s in workload if s.prefix}  # one object per group
        for rep in self.replicas.values():
            for prefix in prefixes.values():
                rep.prewarm(prefix)
            self.stats[rep.replica_id] = rep.report(0.0, self.config.prefix_limit)

    def _idle(self) -> bool:
        return not self.held and not self.inflight and not self.arrivals_due

    def _show_progress(self, t: float, last_arrival: float) -> None:
        done = sum(1 for r in self.records.values() if r.finish is not None)
        sys.stderr.write(f"\r  {self.policy:<11} t={t:7.1f}s / {last_arrival:.0f}s  finished {done}  "
                         f"held {len(self.held)}   ")
        sys.stderr.flush()


def simulate(workload: list[RequestSpec], policy: str, config: SimConfig, progress: bool = False) -> SimResult:
    return Simulation(config, policy, progress).run(workload)
