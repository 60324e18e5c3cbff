"""Per-request records and the summary a simulation run prints."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cluster.pending import Booking


@dataclass
class RequestRecord:
    request_id: str
    arrival: float
    group: int
    num_prompt_tokens: int
    max_tokens: int
    dispatch: float | None = None
    replica: str | None = None
    booking: Booking | None = None  # what the router booked for it at dispatch
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    rejected: bool = False


@dataclass(frozen=True)
class SimResult:
    policy: str
    num_replicas: int
    num_requests: int  # measured (arrived after warmup)
    num_finished: int
    num_rejected: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    queue_p99: float  # time held at the router, P99
    throughput_tok_s: float  # output tokens per second of makespan
    throughput_req_s: float
    preemptions: int
    prefix_hit_rate: float  # the engines' own counters: hit tokens / queried tokens
    max_held: int
    sim_time_s: float
    events: int
    slo_met: float = float("nan")  # goodput: share of measured requests (rejected ones too) with TTFT <= the SLO
    goodput_req_s: float = float("nan")  # those requests per second of the measured arrival window

    ROW = ("policy", "replicas", "requests", "finished", "rejected", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms",
           "TPOT p99 ms", "queue p99 s", "tok/s", "preempt", "prefix hit", "TTFT<=SLO")

    def row(self) -> list[str]:
        return [self.policy, str(self.num_replicas), str(self.num_requests), str(self.num_finished),
                str(self.num_rejected), f"{self.ttft_p50:.3f}", f"{self.ttft_p99:.3f}", f"{self.tpot_p50 * 1e3:.1f}",
                f"{self.tpot_p99 * 1e3:.1f}", f"{self.queue_p99:.3f}", f"{self.throughput_tok_s:.0f}",
                str(self.preemptions), f"{self.prefix_hit_rate:.1%}", f"{self.slo_met:.1%}"]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(policy: str, config, records: list[RequestRecord], replicas: Iterable, end: float,
              rejected: int, max_held: int, events: int) -> SimResult:
    measured = [r for r in records if r.arrival >= config.warmup_s]
    # A request still without its first token when the run stopped counts with the time it waited.
    ttft = [(r.first_token if r.first_token is not None else end) - r.arrival for r in measured if not r.rejected]
    tpot = [(r.finish - r.first_token) / (r.num_output_tokens - 1) for r in measured
            if r.finish is not None and r.num_output_tokens > 1]
    queue = [(r.dispatch if r.dispatch is not None else end) - r.arrival for r in measured if not r.rejected]
    finished = [r for r in records if r.finish is not None]
    t0 = min((r.arrival for r in records), default=0.0)
    t1 = max((r.finish for r in finished), default=t0)
    span = max(t1 - t0, 1e-9)
    sched = [rep.scheduler.stats for rep in replicas]
    query = sum(s.prefix_query_tokens for s in sched)
    slo = getattr(config, "ttft_slo_s", float("inf"))
    good = sum(1 for r in measured if r.first_token is not None and r.first_token - r.arrival <= slo)
    window = max((r.arrival for r in measured), default=0.0) - min((r.arrival for r in measured), default=0.0)
    return SimResult(
        policy=policy, num_replicas=config.num_replicas, num_requests=len(measured),
        num_finished=sum(1 for r in measured if r.finish is not None), num_rejected=sum(r.rejected for r in measured),
        ttft_p50=_pct(ttft, 50), ttft_p99=_pct(ttft, 99), tpot_p50=_pct(tpot, 50), tpot_p99=_pct(tpot, 99),
        queue_p99=_pct(queue, 99), throughput_tok_s=sum(r.num_output_tokens for r in finished) / span,
        throughput_req_s=len(finished) / span, preemptions=sum(s.num_preemptions for s in sched),
        prefix_hit_rate=sum(s.prefix_hit_tokens for s in sched) / query if query else 0.0,
        max_held=max_held, sim_time_s=end, events=events,
        slo_met=good / len(measured) if measured else float("nan"), goodput_req_s=good / window if window > 0 else 0.0)


def markdown_table(results: list[SimResult], extra: dict[str, list[str]] | None = None) -> str:
    """`extra`: leading columns (name -> one value per result)."""
    extra = extra or {}
    head = list(extra) + list(SimResult.ROW)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results):
        lines.append("| " + " | ".join([v[i] for v in extra.values()] + r.row()) + " |")
    return "\n".join(lines)


def comparison_table(pairs: list[tuple[float, SimResult]], field: str = "ttft_p99", fmt: str = "{:.3f}",
                     lower_is_better: bool = True, floors: dict[float, float] | None = None) -> str:
    """One row per load: `field` for every policy, the best of the policies other than kv, and
    kv's change against it (negative: kv is lower); with `floors`, a floor column first."""
    loads = list(dict.fromkeys(load for load, _ in pairs))
    policies = list(dict.fromkeys(r.policy for _, r in pairs))
    peers = [p for p in policies if p != "kv"]
    head = (["load req/s/replica"] + (["floor"] if floors else []) + policies
            + (["best peer", "kv vs best peer"] if "kv" in policies and peers else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pick = min if lower_is_better else max
    for load in loads:
        got = {r.policy: getattr(r, field) for l, r in pairs if l == load}
        row = [f"{load:g}"] + ([fmt.format(floors[load])] if floors else []) + [fmt.format(got[p]) for p in policies]
        if "kv" in got and peers:
            best = pick(peers, key=lambda p: got[p])
            row += [f"{best} {fmt.format(got[best])}", f"{got['kv'] / got[best] - 1:+.0%}" if got[best] else "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
