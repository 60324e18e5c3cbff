"""What one engine replica tells the global scheduler: its engine's routing snapshot, named.

A replica publishes one every few hundred milliseconds (in Serve through
`EngineServer.record_routing_stats`, in the simulator from its report events). The snapshot and
its prefix-hash summary are the engine's own (`engine.snapshot`); here it only gets the id of
the replica it came from, and the figures the policies derive from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.outputs import EngineStats
from engine.scheduler import Scheduler
from engine.snapshot import DEFAULT_PREFIX_LIMIT, snapshot, summarize_prefix_hashes

__all__ = ["ReplicaStats", "build_replica_stats", "DEFAULT_PREFIX_LIMIT", "summarize_prefix_hashes"]


@dataclass(frozen=True)
class ReplicaStats(EngineStats):
    replica_id: str = ""

    @classmethod
    def of(cls, stats: EngineStats, replica_id: str) -> "ReplicaStats":
        return cls(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(EngineStats)}, replica_id=replica_id)

    @property
    def headroom_blocks(self) -> int:
        """Free blocks not yet promised to requests the replica already has."""
        return self.num_free_blocks - self.num_reserved_blocks


def build_replica_stats(replica_id: str, scheduler: Scheduler, now: float,
                        prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> ReplicaStats:
    """A snapshot of one replica from its scheduler (the simulator's replicas, and tests)."""
    return ReplicaStats.of(snapshot(scheduler, prefix_limit, now), replica_id)
