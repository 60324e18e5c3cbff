"""Cluster simulator: the engine's real scheduler and block manager per replica, model time from
a cost model, synthetic workloads, and the routing policies of cluster.policy.

    python -m cluster.sim --replicas 64 --rate 200 --workload shared-prefix --policies kv,pow2,round_robin
    python -m cluster.sim sweep --replicas 64 --out docs/sim     # tables + plots at rising load
"""
from cluster.sim.cost import CostModel, fit
from cluster.sim.replica import ReplicaConfig, SimReplica
from cluster.sim.simulation import SimConfig, Simulation, simulate
from cluster.sim.workload import RequestSpec, WorkloadConfig, generate

__all__ = ["CostModel", "fit", "ReplicaConfig", "SimReplica", "SimConfig", "Simulation", "simulate",
           "RequestSpec", "WorkloadConfig", "generate"]
