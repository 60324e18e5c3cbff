"""What an engine replica reports to Serve's autoscaler (`record_autoscaling_stats`).

The names are the keys `cluster.autoscale.KVPressurePolicy` reads back from Serve's
`AutoscalingContext.aggregated_metrics`; Serve averages each over `look_back_period_s`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from engine.outputs import EngineStats

KV_USAGE = "kvserve_kv_usage"
WAITING_PREFILL_TOKENS = "kvserve_waiting_prefill_tokens"
PREEMPTIONS_PER_S = "kvserve_preemptions_per_s"


class KVMetricsRecorder:
    """Turns engine stats into the numbers Serve averages: cumulative preemptions become a rate."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: tuple[float, int] | None = None

    def record(self, stats: EngineStats) -> dict[str, float]:
        now, count = self.clock(), stats.num_preemptions
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = max(0, count - self._last[1]) / (now - self._last[0])
        self._last = (now, count)
        return {KV_USAGE: stats.kv_usage, WAITING_PREFILL_TOKENS: float(stats.waiting_prefill_tokens),
                PREEMPTIONS_PER_S: rate}
