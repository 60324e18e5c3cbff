"""The engine replica: a thin Serve shim around one injected engine (an `AsyncEngine` by default).

It takes prompt token ids (the ingress tokenizes, so that a router can match cached prefixes on
the same ids) and streams one small `StepOutput` per engine step back to the ingress. When the
caller goes away, Serve cancels this generator; closing the engine's stream aborts the request,
which frees its KV blocks at once.

Each replica also records the engine's Prometheus metrics (router.metrics): gauges from the
engine's stats every second, and per request its TTFT, inter-token gaps, latency and end.

The injected engine needs: `generate(request_id, prompt_token_ids, params)` (an async generator
of `engine.RequestOutput`), `abort`, `stats() -> EngineStats`, `check_health()`, `shutdown()`,
and `engine.max_model_len`. `router.testing.FakeEngine` is one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ray import serve

from cluster.autoscale import KVMetricsRecorder
from cluster.stats import ReplicaStats, replica_stats_from_engine
from engine.config import EngineConfig
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from router.metrics import EngineMetrics, ray_metrics

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], object]


@dataclass
class ChoiceDelta:
    index: int  # which of the request's n samples
    text: str  # new text since the previous step
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # per new token: top-k (+ sampled) token -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort", sent exactly once
    stop_reason: str | int | None = None


@dataclass
class StepOutput:
    """What one engine step produced for one request: only the samples that changed."""
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool


def to_step_output(out: RequestOutput, finished_samples: set[int]) -> StepOutput:
    choices = []
    for c in out.outputs:
        if c.index in finished_samples or not (c.delta_token_ids or c.delta_text or c.finish_reason):
            continue
        choices.append(ChoiceDelta(c.index, c.delta_text, list(c.delta_token_ids), c.delta_logprobs,
                                   c.finish_reason, c.stop_reason))
        if c.finish_reason is not None:
            finished_samples.add(c.index)
    return StepOutput(choices, len(out.prompt_token_ids), out.num_cached_tokens, out.finished)


def finish_reason(step: StepOutput) -> str:
    """Why a finished request ended: its last sample's reason (n > 1: the sample that finished last)."""
    return next((c.finish_reason for c in reversed(step.choices) if c.finish_reason), "abort")


def resolve_engine_factory(engine_cls: str | EngineFactory | None) -> EngineFactory:
    """None -> engine.AsyncEngine; "pkg.module:Name" -> that attribute; a callable as is."""
    if engine_cls is None:
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if isinstance(engine_cls, str):
        module, _, name = engine_cls.partition(":")
        if not name:
            raise ValueError(f"engine_cls must look like 'package.module:Name', got {engine_cls!r}")
        return getattr(importlib.import_module(module), name)
    return engine_cls


def replica_threads(requested: int, quota: float | None) -> int:
    """Torch threads for this replica: as requested (the app builder's default divides the cores
    of the node that built the app), but no more than this pod's CPU limit (its cgroup's CFS
    quota, `engine.cgroup.cpu_quota()`), beyond which threads only get throttled."""
    if quota is None:
        return requested
    return max(1, min(requested, int(quota)))


class EngineServer:
    def __init__(self, engine_config: EngineConfig, engine_cls: str | EngineFactory | None = None,
                 cpu_threads: int | None = None, model_name: str | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        if cpu_threads:
            import torch

            from engine.cgroup import cpu_quota
            torch.set_num_threads(replica_threads(cpu_threads, cpu_quota()))  # Ray leaves OMP_NUM_THREADS=1
        self.engine = resolve_engine_factory(engine_cls)(engine_config)
        self.max_num_seqs = engine_config.max_num_seqs
        self._kv_metrics = KVMetricsRecorder()
        self._replica_id: str | None = None
        self.metrics = metrics or EngineMetrics(ray_metrics(model_name or engine_config.model or "default"))
        self._metrics_task = self.metrics.start_refresh(self.engine.stats)

    async def info(self) -> dict:
        """Limits the ingress checks requests against before sending them here."""
        s = self.engine.stats()
        return {"max_model_len": self.engine.engine.max_model_len, "max_num_seqs": self.max_num_seqs,
                "block_size": s.block_size, "num_total_blocks": s.num_total_blocks}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StepOutput]:
        finished_samples: set[int] = set()
        timer = self.metrics.start_request(len(prompt_token_ids))
        reason = "abort"  # unless the engine says otherwise: a caller that went away aborted it
        try:
            # aclosing: a cancelled or closed caller must close the engine's stream too (-> abort).
            async with contextlib.aclosing(self.engine.generate(request_id, prompt_token_ids, params)) as stream:
                async for out in stream:
                    step = to_step_output(out, finished_samples)
                    timer.tokens(sum(len(c.token_ids) for c in step.choices),
                                 steps=max((len(c.token_ids) for c in step.choices), default=0))
                    if step.finished:
                        reason = finish_reason(step)
                    yield step
        except Exception:  # not CancelledError / GeneratorExit: those are the caller leaving
            reason = "error"
            raise
        finally:
            timer.finish(reason)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    def _replica_key(self) -> str:
        """This replica's full id string, as the router keys replicas (`replica_id.to_full_id_str()`)."""
        if self._replica_id is None:
            try:
                self._replica_id = serve.get_replica_context().replica_id.to_full_id_str()
            except Exception:  # not inside a Serve replica (unit tests call the class directly)
                return "local"
        return self._replica_id

    def replica_stats(self, now: float | None = None) -> ReplicaStats:
        """The KV state the router needs. A real engine's scheduler and block manager are read
        directly (the containers are copied first: the model step runs on another thread); an
        engine without a scheduler (router.testing.FakeEngine) reports its EngineStats and no
        cached prefixes."""
        now = time.time() if now is None else now
        inner = getattr(self.engine, "engine", None)
        if getattr(inner, "scheduler", None) is not None:
            return replica_stats_from_engine(inner, self._replica_key(), now)
        s = self.engine.stats()
        return ReplicaStats(replica_id=self._replica_key(), num_free_blocks=s.num_free_blocks,
                            num_total_blocks=s.num_total_blocks, block_size=s.block_size, num_reserved_blocks=0,
                            num_running=s.num_running, num_waiting=s.num_waiting, max_num_seqs=self.max_num_seqs,
                            waiting_prefill_tokens=s.waiting_prefill_tokens, num_preemptions=s.num_preemptions,
                            prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
                            prefix_hashes=frozenset(), timestamp=now)

    async def record_routing_stats(self) -> dict:
        """Serve's hook: what a custom RequestRouter sees of this replica (every
        request_routing_stats_period_s): a `cluster.stats.ReplicaStats` as a dict, plus the
        engine's own counters."""
        s = self.engine.stats()
        return {**dataclasses.asdict(s), "kv_usage": s.kv_usage, "prefix_hit_rate": s.prefix_hit_rate,
                **self.replica_stats().to_dict()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics (cluster.autoscale.KVPressurePolicy reads them)."""
        return self._kv_metrics.record(self.engine.stats())

    async def check_health(self) -> None:
        self.engine.check_health()  # raises when the engine loop has died; Serve then replaces us

    async def shutdown(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        await self.engine.shutdown()


class _EngineReplica(EngineServer):
    async def __del__(self) -> None:
        # Serve calls this after draining in-flight requests (graceful_shutdown_timeout_s).
        with contextlib.suppress(Exception):
            await self.shutdown()


EngineDeployment = serve.deployment(name="EngineServer")(_EngineReplica)
