"""A tensor-parallel worker group: N rank actors in one placement group, their start-up, health
and teardown.

    placement group (STRICT_PACK, one node): [bundle 0][bundle 1] ... [bundle N-1]
                                              rank 0    rank 1        rank N-1
    start-up, each stage bounded by a timeout that names the ranks that did not answer:
      every rank process starts -> rank 0 opens a TCPStore on a free loopback port
      -> ranks > 0 connect to it (join) -> init_process_group (NCCL on CUDA, gloo on CPU)
      -> load (rank 0 reads the checkpoint and scatters the shards)
      -> KV blocks: the minimum any rank can hold -> every rank allocates that many

A rank that dies or raises, or a step that outlives its timeout, marks the group unhealthy for
good: it is torn down at once (the other ranks may be stuck in a collective waiting for the
lost one) and every later call raises WorkerGroupError. A new WorkerGroup is the rebuild.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.model.layers import SAMPLING_RANK
from workers.messages import Draws, StepMessage
from workers.rank import CONCURRENCY_GROUPS, RankWorker

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_ENV = "KVSERVE_LOAD_TIMEOUT_S"  # set by cluster.app from its load_timeout_s argument


def _default_load_timeout_s() -> float:
    return float(os.environ.get(LOAD_TIMEOUT_ENV, 900.0))


@dataclass(frozen=True)
class WorkerGroupConfig:
    placement_timeout_s: float = 60.0  # reserving the bundles
    start_timeout_s: float = 180.0  # rank processes start (spawn, imports, device context)
    join_timeout_s: float = 60.0  # per rendezvous stage: store, connect, process group
    # Reading + scattering the weights, sizing the KV cache: rank 0 reads the whole checkpoint, so
    # this bounds checkpoint size / volume read rate (cluster.sizing checks it before deploying).
    load_timeout_s: float = field(default_factory=_default_load_timeout_s)
    step_timeout_s: float = 600.0  # one step on every rank; a dead rank is noticed at once anyway
    health_timeout_s: float = 10.0  # a ping to every rank
    diagnose_grace_s: float = 2.0  # after a failure, how long to wait for the others' errors
    cpus_per_rank: float | None = None  # CPU ranks: None -> min(1, largest node's CPUs / tp)
    use_gpu: bool | None = None  # None: when config.device allows and the cluster has >= tp GPUs

    def __post_init__(self) -> None:
        for name in ("placement_timeout_s", "start_timeout_s", "join_timeout_s", "load_timeout_s",
                     "step_timeout_s", "health_timeout_s", "diagnose_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cpus_per_rank is not None and self.cpus_per_rank <= 0:
            raise ValueError(f"cpus_per_rank must be > 0, got {self.cpus_per_rank}")


class WorkerGroupError(RuntimeError):
    """The worker group failed (a rank died, raised or timed out); it cannot serve any more."""


def _wants_gpu(config: EngineConfig, gc: WorkerGroupConfig, size: int, reserved: list[dict] | None = None) -> bool:
    """`reserved`: the bundles a Serve deployment placed this replica in (bundle 1 + r is rank
    r's), which already decided: ranks that asked otherwise would not fit in them."""
    if gc.use_gpu is not None:
        return gc.use_gpu
    if reserved is not None:
        return reserved[1].get("GPU", 0) > 0
    gpus = ray.cluster_resources().get("GPU", 0)
    if config.device.startswith("cuda") and gpus < size:
        raise WorkerGroupError(f"tensor_parallel_size={size} on cuda needs {size} GPUs; the Ray cluster has {gpus:g}")
    return config.device.startswith("cuda") or (config.device == "auto" and gpus >= size)


def _describe(rank: int, e: Exception, what: str) -> str:
    if isinstance(e, RayActorError):
        return f"rank {rank} died during '{what}' ({str(e).strip().splitlines()[0]})"
    if isinstance(e, RayTaskError) and e.cause is not None:
        return f"rank {rank} failed to {what}: {type(e.cause).__name__}: {e.cause}"
    return f"rank {rank} could not {what}: {type(e).__name__}: {e}"


class WorkerGroup:
    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: list[int],
                 group_config: WorkerGroupConfig = WorkerGroupConfig(), worker_cls: type = RankWorker) -> None:
        self.config, self.gc = config, group_config
        self.eos_token_ids = eos_token_ids  # the sampling rank masks them until min_tokens
        self.size = config.tensor_parallel_size
        self.pg = None
        self.owns_pg = True
        self.ranks: list = []
        self.error: str | None = None
        self.reports: list[dict] = []
        self.num_blocks = 0
        self.device = "cpu"
        t0 = time.perf_counter()
        try:
            self._start(model_dir, worker_cls)
        except BaseException:
            self.shutdown()
            raise
        self.startup_s = time.perf_counter() - t0

    @property
    def healthy(self) -> bool:
        return self.error is None and bool(self.ranks)

    # -- start-up ------------------------------------------------------------------------------
    def _start(self, model_dir: str, worker_cls: type) -> None:
        replica_pg = self._replica_group()
        gpu = _wants_gpu(self.config, self.gc, self.size, replica_pg and replica_pg.bundle_specs)
        self.device = "cuda" if gpu else "cpu"  # each rank finds its own GPU's index (local_gpu_index)
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": self._cpus_per_rank()}
        first = self._reserve(bundle, replica_pg)
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(worker_cls)
        self.ranks = [actor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=first + r),
        ).remote(r, self.size, self.config, model_dir, self.device, self.eos_token_ids) for r in range(self.size)]
        self._gather(self._all("ping"), self.gc.start_timeout_s, "start")
        backend = self._rendezvous()
        loads = self._gather(self._all("load"), self.gc.load_timeout_s, "load the model")
        self.reports = [loads[r] for r in range(self.size)]
        self.num_blocks = min(r["max_blocks"] for r in self.reports)  # what every rank can hold
        kv = self._gather(self._all("allocate_kv", self.num_blocks), self.gc.load_timeout_s, "allocate the KV cache")
        for r in self.reports:
            r.update(kv[r["rank"]])
            logger.info("rank %d: %.1f MiB of parameters (%.1f MiB in every form held), %.1f MiB of KV cache, "
                        "%d bytes read from storage, peak memory %.0f MiB", r["rank"], r["param_bytes"] / 2**20,
                        r["held_bytes"] / 2**20, r["kv_bytes"] / 2**20, r["bytes_read"],
                        r["memory_after_load"]["peak_bytes"] / 2**20)
        logger.info("worker group up: tp=%d (%s) on %s, %d KV blocks, %d bytes read from storage", self.size,
                    backend, self.device, self.num_blocks, sum(r["bytes_read"] for r in self.reports))

    def _replica_group(self):
        """The placement group of a Serve replica whose deployment reserved
        `placement_group_bundles` (bundle 0 for the replica, 1 + r for rank r), else None."""
        current = ray.util.get_current_placement_group()
        return current if current is not None and len(current.bundle_specs) >= 1 + self.size else None

    def _reserve(self, bundle: dict, current) -> int:
        """-> index of rank 0's bundle. In a replica's group (`current`) the ranks use its
        bundles instead of reserving their resources a second time."""
        if current is not None:
            strategy = ray.util.placement_group_table(current).get("strategy")
            if strategy != "STRICT_PACK":  # ranks on two nodes would wait for each other on loopback
                raise WorkerGroupError(f"the replica's placement group is {strategy}; tensor-parallel ranks "
                                       "rendezvous over loopback, so it must be STRICT_PACK (one node)")
            self.pg, self.owns_pg = current, False
            return 1
        self.pg, self.owns_pg = placement_group([dict(bundle)] * self.size, strategy="STRICT_PACK"), True
        ready, _ = ray.wait([self.pg.ready()], timeout=self.gc.placement_timeout_s)
        if not ready:
            raise WorkerGroupError(f"could not reserve {self.size} x {bundle} on one node within "
                                   f"{self.gc.placement_timeout_s:g}s (cluster: {ray.cluster_resources()})")
        return 0

    def _rendezvous(self) -> str:
        t = self.gc.join_timeout_s
        port = self._gather({0: self.ranks[0].open_store.remote(t)}, t, "open the rendezvous store")[0]
        self._gather({r: a.connect.remote(port, t) for r, a in enumerate(self.ranks) if r}, t, "join the group")
        # The collectives' own timeout only bounds a hang that the engine has not acted on already.
        return self._gather(self._all("init_collective", self.gc.load_timeout_s), t, "initialise torch.distributed")[0]

    def _cpus_per_rank(self) -> float:
        """A whole CPU per rank where the largest node has them, else an equal fraction of it, so
        that tp=3 still fits on a 2-core laptop (each rank runs cores // tp torch threads)."""
        if self.gc.cpus_per_rank is not None:
            return self.gc.cpus_per_rank
        cpus = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=1)
        return max(0.01, min(1.0, math.floor(100 * cpus / self.size) / 100))

    # -- calling every rank --------------------------------------------------------------------
    def _all(self, method: str, *args) -> dict:
        return {r: getattr(a, method).remote(*args) for r, a in enumerate(self.ranks)}

    def _gather(self, refs: dict, timeout_s: float, what: str) -> dict:
        """{rank: ref} -> {rank: result}; the first rank that dies or raises fails the group at
        once, without waiting for ranks that may be stuck in a collective with it."""
        if self.error is not None:
            raise WorkerGroupError(f"worker group is unhealthy: {self.error}")
        rank_of = {ref: r for r, ref in refs.items()}
        results, pending = {}, list(refs.values())
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(rank_of[ref] for ref in pending)
                self._fail(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                           f"{what} within {timeout_s:g}s")
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except RayError as e:
                self._fail(self._diagnose({rank_of[ref]: e}, pending, rank_of, what))
        return results

    def _diagnose(self, errors: dict, pending: list, rank_of: dict, what: str) -> str:
        """One rank failed: give the others a moment, so that a rank that died is named first,
        before the peers whose collectives broke because of it."""
        if pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=self.gc.diagnose_grace_s)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError as e:
                    errors[rank_of[ref]] = e
        died = sorted(r for r, e in errors.items() if isinstance(e, RayActorError))
        return "; ".join(_describe(r, errors[r], what) for r in died + sorted(set(errors) - set(died)))

    def _fail(self, message: str) -> None:
        self.error = message
        logger.error("worker group failed: %s", message)
        self._teardown()
        raise WorkerGroupError(message)

    # -- serving -------------------------------------------------------------------------------
    def execute(self, msg: StepMessage) -> Draws:
        """Send the step to every rank, its sampling part to the sampling rank only; -> that
        rank's draws."""
        others = dataclasses.replace(msg, sampling=None)
        refs = {r: a.execute.remote(msg if r == SAMPLING_RANK else others) for r, a in enumerate(self.ranks)}
        return self._gather(refs, self.gc.step_timeout_s, f"run step {msg.step}")[SAMPLING_RANK]

    def call_all(self, method: str, *args) -> list:
        """Every rank's answer to `method(*args)` (one of RankWorker's), in rank order."""
        answers = self._gather(self._all(method, *args), self.gc.step_timeout_s, f"run {method}")
        return [answers[r] for r in range(self.size)]

    def check_health(self) -> None:
        """Raise WorkerGroupError unless every rank answers a ping in time."""
        self._gather(self._all("ping"), self.gc.health_timeout_s, "answer a ping")

    def pids(self) -> list[int]:
        pids = self._gather(self._all("pid"), self.gc.health_timeout_s, "report its pid")
        return [pids[r] for r in range(self.size)]

    # -- teardown ------------------------------------------------------------------------------
    def _teardown(self) -> None:
        for a in self.ranks:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.ranks = []
        if self.pg is not None and self.owns_pg:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def shutdown(self) -> None:
        """Kill every rank and release the placement group; idempotent."""
        if self.error is None and self.ranks:
            self.error = "shut down"
        self._teardown()
