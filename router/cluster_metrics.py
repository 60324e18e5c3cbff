"""`GET /metrics` on the API port: the engine's Prometheus series from every Ray node, on one page.

Each engine replica records its metrics with Ray (workers/metrics.py), and every Ray node's
metrics agent exports those of the processes on it (`ray_kvserve_*`, on its metrics export port).
vLLM users scrape the API port instead; this page reads each live node's export, keeps the
`ray_kvserve_*` families, merges them across nodes and renders them again, names and labels
unchanged, so a dashboard reads the same series from either place; and each again under vLLM's
own name (`vllm:num_requests_running` for `ray_kvserve_num_requests_running`: kvserve names its
metrics as vLLM does, kvserve_ for vllm:), so a dashboard made for vLLM's /metrics charts them
too. A node that does not answer
within FETCH_TIMEOUT_S is left out of that page. Pages are reused for CACHE_S: a scraper
hammering the endpoint costs one round of fetches a second.
"""
from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PREFIX = "ray_kvserve_"
VLLM_PREFIX = "vllm:"
CACHE_S = 1.0
FETCH_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def live_export_urls() -> list[str]:
    """Every live Ray node's metrics export, from the GCS (a blocking call)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


def merge_kvserve_families(pages: list[str]) -> str:
    """The `ray_kvserve_*` families of several Prometheus text pages, one family each, in the
    exposition format."""
    families = {}
    for page in pages:
        for family in text_string_to_metric_families(page):
            if not family.name.startswith(PREFIX):
                continue
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    ordered = [families[name] for name in sorted(families)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(ordered + [_as_vllm(f) for f in ordered]))
    return generate_latest(registry).decode()


def _as_vllm(family: Metric) -> Metric:
    """The family under vLLM's name for it, samples and labels as they are."""
    def renamed(name: str) -> str:
        return VLLM_PREFIX + name[len(PREFIX):]

    out = Metric(renamed(family.name), family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=renamed(s.name)) for s in family.samples]
    return out


class _Fixed:
    """A collector of families read elsewhere."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


class ClusterMetrics:
    """`await page()` -> the merged page, at most CACHE_S old."""

    def __init__(self, urls: Callable[[], list[str]] = live_export_urls,
                 fetch: Callable[[list[str]], Awaitable[list[str]]] | None = None) -> None:
        self._urls, self._fetch = urls, fetch or _fetch_all
        self._page, self._at = "", float("-inf")
        self._lock = asyncio.Lock()

    async def page(self) -> str:
        async with self._lock:  # concurrent scrapes share one round of fetches
            if time.monotonic() - self._at >= CACHE_S:
                pages = await self._fetch(await asyncio.to_thread(self._urls))
                self._page = await asyncio.to_thread(merge_kvserve_families, pages)
                self._at = time.monotonic()
            return self._page


async def _fetch_all(urls: list[str]) -> list[str]:
    answers = await asyncio.gather(*(asyncio.to_thread(_get, url) for url in urls), return_exceptions=True)
    pages = []
    for url, answer in zip(urls, answers):
        if isinstance(answer, Exception):
            logger.warning("metrics export %s left out of /metrics: %s", url, answer)
        else:
            pages.append(answer)
    return pages


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:  # raises on an HTTP error status
        return r.read().decode()
