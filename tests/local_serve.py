"""A local Ray + Serve running the kvserve application, for tests that go through HTTP."""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: dict, num_cpus: int = 4, app_name: str = "kvserve",
                   ray_options: dict | None = None) -> Iterator[str]:
    """A local Ray + Serve running `cluster.app.build_app(args)` on a free 127.0.0.1 port; yields its
    base URL and leaves nothing running afterwards. `ray_options`: more keyword arguments for ray.init."""
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.serve_env import apply_serve_env

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    port = free_port()
    saved = dict(os.environ)
    apply_serve_env()  # the Serve settings `kvserve serve` runs with, for the Ray started here
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, **(ray_options or {}))
    finally:  # not for the Rays later test modules start in this process
        os.environ.clear()
        os.environ.update(saved)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
