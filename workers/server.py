"""The engine replica: a thin Serve shim around one injected engine (an `AsyncEngine` by default).

It lives in workers/ because a replica is exactly one worker group: its engine runs the
tensor-parallel ranks (workers.executor) in the replica's placement group. The OpenAI layer in
router/ only sees it through a Serve handle and the `engine.outputs.StepOutput` it streams.

It takes prompt token ids (the ingress tokenizes, so that a router can match cached prefixes on
the same ids) and streams one small `StepOutput` per engine step back to the ingress. When the
caller goes away, Serve cancels this generator; closing the engine's stream aborts the request,
which frees its KV blocks at once.

Each replica also records the engine's Prometheus metrics (workers.metrics): gauges from the
engine's stats every second, and per request its TTFT, inter-token gaps, latency and end; and
every 10 s while it works it logs vLLM's stats line (workers.stat_logger).

The injected engine meets `engine.protocol.EngineClient` (tests inject a fake one).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
from collections.abc import AsyncIterator, Callable

from ray import serve

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.outputs import EngineStats, StepOutput
from engine.protocol import EngineClient
from engine.sampling_params import SamplingParams
from workers.autoscale_stats import KVMetricsRecorder
from workers.metrics import ReplicaMetrics, ray_metrics
from workers.serve_logging import log_through_serve
from workers.stat_logger import StatLogger, interval_from_env

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], EngineClient]


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


def _fields(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


class EngineServer:
    def __init__(self, engine_config: EngineConfig, engine_cls: str | EngineFactory | None = None,
                 cpu_threads: int | None = None, model_name: str | None = None,
                 metrics: ReplicaMetrics | None = None, log_stats: bool = True) -> None:
        """`log_stats`: log the engine's throughput and queue every interval (workers.stat_logger)."""
        if cpu_threads:
            import torch

            from engine.cgroup import cpu_quota
            torch.set_num_threads(replica_threads(cpu_threads, cpu_quota()))  # Ray leaves OMP_NUM_THREADS=1
        self.engine: EngineClient = resolve_engine_factory(engine_cls)(engine_config)
        self.max_num_seqs, self.max_logprobs = engine_config.max_num_seqs, engine_config.max_logprobs
        self.scheduling_policy = engine_config.scheduling_policy
        self._kv_metrics = KVMetricsRecorder()
        self._replica_id: str | None = None
        self.metrics = metrics or ReplicaMetrics(ray_metrics(model_name or engine_config.model or "default"),
                                                 stat_logger=StatLogger(interval_from_env()) if log_stats else None,
                                                 cache_config=engine_config)
        self._metrics_task = self.metrics.start_refresh(self.engine.stats)

    async def info(self) -> dict:
        """Limits the ingress checks requests against before sending them here."""
        s = self.engine.stats()
        # vocab_size: the token ids the model has (for the ingress to refuse others itself);
        # eos_token_ids: those that end a reply (beam search, run at the ingress, needs them);
        # None from an engine that does not say.
        return {"max_model_len": self.engine.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_logprobs": self.max_logprobs, "scheduling_policy": self.scheduling_policy,
                "block_size": s.block_size, "num_total_blocks": s.num_total_blocks,
                "vocab_size": getattr(self.engine, "vocab_size", None),
                "eos_token_ids": getattr(self.engine, "eos_token_ids", None),
                # a pooling engine's engine.pooling.PoolerConfig fields; None: it generates
                "pooler": _fields(getattr(self.engine, "pooler", None))}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       admitted: bool = False) -> AsyncIterator[StepOutput]:
        """`admitted`: router.serving.ReplicaClient's, for a server used in process (tests): no
        queue stands in front of it, so there is nothing to wait for."""
        finished_samples: set[int] = set()
        sample_tokens: dict[int, int] = {}  # each sample's tokens so far, by its index
        room = self.engine.max_model_len - len(prompt_token_ids)  # vLLM's max_tokens when none is given
        timer = self.metrics.start_request(len(prompt_token_ids), params.n,
                                           params.max_tokens if params.max_tokens is not None else room)
        reason = "abort"  # unless the engine says otherwise: a caller that went away aborted it
        try:
            # aclosing: a cancelled or closed caller must close the engine's stream too (-> abort).
            async with contextlib.aclosing(self.engine.generate(request_id, prompt_token_ids, params)) as stream:
                first = True  # the prompt logprobs go with the first output only
                async for out in stream:
                    step = StepOutput.from_request_output(out, finished_samples, first)
                    if first:
                        timer.scheduled(out.first_scheduled_time, out.num_cached_tokens)
                    first = False
                    timer.preempted(out.num_preemptions)
                    for c in step.choices:
                        sample_tokens[c.index] = sample_tokens.get(c.index, 0) + len(c.token_ids)
                    timer.tokens(sum(len(c.token_ids) for c in step.choices),
                                 steps=max((len(c.token_ids) for c in step.choices), default=0),
                                 longest=max(sample_tokens.values(), default=0))
                    if step.pooled is not None:
                        timer.pooled()
                    if step.finished:
                        reason = step.finish_reason
                    yield step
        except InvalidRequestError:  # refused before it ran: not a request the engine served
            reason = None
            raise
        except Exception:  # not CancelledError / GeneratorExit: those are the caller leaving
            reason = "error"
            if not self._engine_alive():
                self._engine_died()
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

    async def record_routing_stats(self) -> dict:
        """Serve's hook: what a custom RequestRouter sees of this replica (every
        request_routing_stats_period_s): the engine's routing snapshot as a plain dict, with this
        replica's id (`cluster.stats.ReplicaStats.from_dict` reads it back)."""
        return {**self.engine.routing_snapshot().to_dict(), "replica_id": self._replica_key()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics (cluster.autoscale.KVPressurePolicy reads them)."""
        return self._kv_metrics.record(self.engine.stats())

    async def check_health(self) -> None:
        try:
            self.engine.check_health()  # raises when the engine loop has died; Serve then replaces us
        except Exception:
            self._engine_died()
            raise

    def _engine_alive(self) -> bool:
        try:
            self.engine.check_health()
        except Exception:
            return False
        return True

    def _engine_died(self) -> None:
        """Called once the engine can no longer serve (the deployment's replica exits)."""

    async def shutdown(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        await self.engine.shutdown()


class _EngineReplica(EngineServer):
    """A replica whose engine died exits, a moment after the error went out to its streams, as
    vLLM's API server exits when its engine core dies. Serve and every router then see a dead
    actor at once, as when the replica itself is killed: requests not yet started go to another
    replica and Serve starts a new one. Alive, it would be sent requests it can only fail until
    three health checks in a row had failed (3 s at the default period), and the KV router would
    keep choosing it on its last report's free blocks."""

    EXIT_AFTER_S = 0.2
    _stopping = False

    def __init__(self, *args, **kwargs) -> None:
        log_through_serve("engine", "workers")  # the model loading, the KV pool's size, the stats line
        super().__init__(*args, **kwargs)

    def _engine_died(self) -> None:
        if self._stopping:  # a stopped engine reads as dead; Serve is stopping this replica anyway
            return
        self._stopping = True
        logger.error("the engine can no longer serve; this replica exits so that Serve replaces it")
        asyncio.get_running_loop().call_later(self.EXIT_AFTER_S, os._exit, 1)

    async def __del__(self) -> None:
        # Serve calls this after draining in-flight requests (graceful_shutdown_timeout_s).
        self._stopping = True
        with contextlib.suppress(Exception):
            await self.shutdown()


EngineDeployment = serve.deployment(name="EngineServer")(_EngineReplica)
