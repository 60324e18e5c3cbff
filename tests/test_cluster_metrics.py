"""router.cluster_metrics: the API port's /metrics page from the Ray nodes' exports."""
import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import cluster_metrics
from router.cluster_metrics import ClusterMetrics, merge_kvserve_families

NODE_A = """# HELP ray_kvserve_num_preemptions_total Preemptions
# TYPE ray_kvserve_num_preemptions_total counter
ray_kvserve_num_preemptions_total{model_name="m",replica="a"} 3.0
# HELP ray_kvserve_kv_cache_usage_perc KV blocks in use
# TYPE ray_kvserve_kv_cache_usage_perc gauge
ray_kvserve_kv_cache_usage_perc{model_name="m",replica="a"} 0.25
# HELP ray_serve_num_http_requests_total Serve's own
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 7.0
"""
NODE_B = """# HELP ray_kvserve_num_preemptions_total Preemptions
# TYPE ray_kvserve_num_preemptions_total counter
ray_kvserve_num_preemptions_total{model_name="m",replica="b"} 1.0
# HELP ray_kvserve_time_to_first_token_seconds TTFT
# TYPE ray_kvserve_time_to_first_token_seconds histogram
ray_kvserve_time_to_first_token_seconds_bucket{le="0.1",model_name="m",replica="b"} 2.0
ray_kvserve_time_to_first_token_seconds_bucket{le="+Inf",model_name="m",replica="b"} 3.0
ray_kvserve_time_to_first_token_seconds_count{model_name="m",replica="b"} 3.0
ray_kvserve_time_to_first_token_seconds_sum{model_name="m",replica="b"} 0.5
"""


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_merge_keeps_kvserve_families_of_every_node_once_each():
    page = merge_kvserve_families([NODE_A, NODE_B])
    assert page.count("# TYPE ray_kvserve_num_preemptions_total counter") == 1
    assert "ray_serve_" not in page
    expected = {k: v for k, v in {**_samples(NODE_A), **_samples(NODE_B)}.items()
                if k[0].startswith("ray_kvserve_")}
    # and again under vLLM's names, for dashboards made for vLLM's /metrics
    as_vllm = {("vllm:" + name[len("ray_kvserve_"):], labels): v for (name, labels), v in expected.items()}
    assert _samples(page) == {**expected, **as_vllm}
    assert page.count("# TYPE vllm:num_preemptions_total counter") == 1
    assert "vllm:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\",replica=\"b\"} 2.0" in page
    assert merge_kvserve_families([]) == ""


def test_pages_are_reused_for_a_second_and_a_silent_node_is_left_out(monkeypatch):
    calls = []

    async def fetch(urls):
        calls.append(urls)
        return [NODE_A]

    clock = [100.0]
    monkeypatch.setattr(cluster_metrics.time, "monotonic", lambda: clock[0])
    metrics = ClusterMetrics(urls=lambda: ["http://a/metrics"], fetch=fetch)

    async def scrape(n: int) -> list[str]:
        return await asyncio.gather(*(metrics.page() for _ in range(n)))

    pages = asyncio.run(scrape(5))
    assert len(calls) == 1 and len(set(pages)) == 1 and "replica=\"a\"" in pages[0]
    clock[0] += cluster_metrics.CACHE_S
    asyncio.run(scrape(1))
    assert len(calls) == 2


def test_fetch_all_skips_nodes_that_fail(monkeypatch, caplog):
    def get(url):
        if "down" in url:
            raise OSError("connection refused")
        return NODE_A

    monkeypatch.setattr(cluster_metrics, "_get", get)
    pages = asyncio.run(cluster_metrics._fetch_all(["http://up/metrics", "http://down/metrics"]))
    assert pages == [NODE_A]
    assert "http://down/metrics left out of /metrics: connection refused" in caplog.text


@pytest.mark.parametrize("key", [None, "k-123"])
def test_metrics_route_needs_no_key_and_serves_the_page(key):
    from types import SimpleNamespace

    import httpx

    from router.api import build_api
    from router.settings import RouterSettings

    async def page():
        return "ray_kvserve_x 1.0\n"

    from router.api import Admission

    admission = Admission(1.0)
    app = build_api(SimpleNamespace(settings=RouterSettings(served_model_name="m", api_key=key)), metrics=page,
                    admission=admission)

    async def get(path, method="GET"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path)

    r = asyncio.run(get("/metrics"))
    assert r.status_code == 200 and r.text == "ray_kvserve_x 1.0\n"
    assert r.headers["content-type"] == cluster_metrics.CONTENT_TYPE
    assert asyncio.run(get("/metrics", "HEAD")).status_code == 200
    if key:
        assert asyncio.run(get("/v1/models")).status_code == 401  # while the key guards the API
    admission.drain()  # while draining too: a scraper wants it most then
    assert asyncio.run(get("/metrics")).status_code == 200 and admission.in_flight == 0
