"""The engine replica's metrics (engine.metrics) recorded with Ray Serve's metrics API:
workers.server.EngineServer records them, so each Ray node exports them on its metrics port
(`metrics-export-port`) and the Ray dashboard sees them. Prometheus names gain Ray's `ray_`
prefix, counters `_total`, histograms `_bucket` / `_sum` / `_count`; every series carries
`model_name` and, from Serve, `deployment`, `replica` and `application`.

The gauges and engine counters come from an EngineStats snapshot every REFRESH_PERIOD_S; each
refresh also hands the snapshot to the replica's `stat_logger` (workers.stat_logger), which logs
vLLM's periodic stats line when its interval ends.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from engine.metrics import METRICS, MODEL_NAME, ZERO_TAGS, EngineMetrics
from engine.outputs import EngineStats
from workers.stat_logger import StatLogger

logger = logging.getLogger(__name__)

REFRESH_PERIOD_S = 1.0  # gauges and engine counters; Ray exports every 10 s by default anyway


def ray_metrics(model_name: str) -> dict[str, object]:
    """One ray.serve.metrics object per spec, tagged with the model. Inside a Serve replica they
    also get its deployment, replica and application tags; outside Ray they record nothing.
    Every counter series is exported at 0 from the start, as vLLM's are, so that a Grafana panel
    (rate of preemptions, prefix-cache hit rate) shows 0 rather than "No data"."""
    from ray.serve import metrics

    out = {}
    for spec in METRICS:
        keys = (MODEL_NAME, *spec.tag_keys)
        cls = getattr(metrics, spec.kind)
        if spec.buckets:
            m = cls(spec.name, spec.description, boundaries=list(spec.buckets), tag_keys=keys)
        else:
            m = cls(spec.name, spec.description, tag_keys=keys)
        m.set_default_tags({MODEL_NAME: model_name})
        if spec.kind == "Counter":
            for tags in ZERO_TAGS.get(spec.name, [{}]):
                # Counter.inc refuses 0; the recorder it forwards to takes it and creates the series.
                m._record(0, tags=tags)
        out[spec.name] = m
    return out


class ReplicaMetrics(EngineMetrics):
    """EngineMetrics with the replica's periodic refresh (and stats line)."""

    def __init__(self, sinks: Mapping[str, object], clock: Callable[[], float] = time.monotonic,
                 stat_logger: StatLogger | None = None, cache_config: object = None) -> None:
        """`stat_logger`: the periodic log line (workers.stat_logger), written at each refresh it ends."""
        super().__init__(sinks, clock, cache_config)
        self.stat_logger = stat_logger

    def refresh(self, stats: EngineStats) -> None:
        """The gauges and engine counters from one snapshot, and the stats line if one is due."""
        self.record_stats(stats)
        if self.stat_logger is not None and (line := self.stat_logger.line(stats)) is not None:
            logger.info(line)

    async def refresh_forever(self, stats_fn: Callable[[], EngineStats],
                              period_s: float = REFRESH_PERIOD_S) -> None:
        while True:
            try:
                self.refresh(stats_fn())
            except Exception:  # a metrics hiccup must not end the loop
                logger.warning("engine metrics: reading the engine's stats failed", exc_info=True)
            await asyncio.sleep(period_s)

    def start_refresh(self, stats_fn: Callable[[], EngineStats]) -> asyncio.Task | None:
        """refresh_forever as a task on the running event loop (a Serve replica is constructed on
        its own); None outside one, e.g. a test constructing EngineServer directly."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return loop.create_task(self.refresh_forever(stats_fn))
