"""A local Ray + Serve running the kvserve application, for tests that go through HTTP."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator


def wait_ready(url: str, want: int, timeout_s: float) -> float | None:
    """Polls the server's /ready until it answers `want`: the time.monotonic() it did, else None."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if httpx.get(f"{url}/ready", timeout=5).status_code == want:
            return time.monotonic()
        time.sleep(0.05)
    return None


def in_background(fn, *args):
    """fn(*args) on a thread of its own from now: a future of its result. A test times an event
    from the instant it caused it, not after the other things it does meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def stream_events(url: str, body: dict, started=None, timeout_s: float = 120.0) -> list[str] | tuple:
    """POSTs `body` (streamed) to the server's /v1/completions -> the data of its SSE events
    ("[DONE]" last when the stream ended whole); for a reply that is not a 200, (its status, its
    body); for a stream an HTTP error cut, (the error's type, its words, the last two events).
    `started` (a threading.Event) is set at the first event."""
    import httpx

    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode(errors="replace")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    except httpx.HTTPError as e:
        return type(e).__name__, str(e), events[-2:]
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ray_as_kvserve_serve(**ray_init) -> None:
    """ray.init with the Serve settings `kvserve serve` runs with (cluster.serve_env) in the
    environment its processes inherit, and this process's environment given back afterwards, so
    that the Rays later test modules start run as they set themselves up."""
    import ray

    from cluster.serve_env import apply_serve_env

    saved = dict(os.environ)
    apply_serve_env()
    try:
        ray.init(**ray_init)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def running_server(args: dict, num_cpus: int = 4, app_name: str = "kvserve",
                   ray_options: dict | None = None) -> Iterator[str]:
    """A local Ray + Serve running `cluster.app.build_app(args)` on a free 127.0.0.1 port; yields its
    base URL and leaves nothing running afterwards. `ray_options`: more keyword arguments for ray.init."""
    import ray
    from ray import serve

    from cluster.app import build_app

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    init_ray_as_kvserve_serve(num_cpus=num_cpus, include_dashboard=False, **(ray_options or {}))
    try:
        port = _start_serve(serve)
        serve.run(build_app(args), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _start_serve(serve, tries: int = 3) -> int:
    """serve.start on a free loopback port, chosen after Ray's own processes have taken theirs; a
    port some other process took between the choice and the proxy's bind is chosen again."""
    for attempt in range(tries):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # RayTaskError wrapping the proxy's "Failed to bind to address"
            if "Failed to bind" not in str(e) or attempt == tries - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")
