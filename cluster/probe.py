"""Readiness of a Ray pod that serves kvserve, for KubeRay's exec readinessProbe:

    python -m cluster.probe [--serve-port 8000] [--agent-port 52365]

Exit 0 when this pod can serve a request now: KubeRay's own checks pass (the dashboard agent's
api/local_raylet_healthz and the Serve proxy's /-/healthz both say "success") and the app's
/ready says the model can serve. /ready is 200 when every engine replica has loaded (or Serve
holds the engine at zero replicas, or a failed config update left the running version serving); it is
also ready, for the pod, when /ready is 503 but some replica is RUNNING and the app is not
draining, i.e. a scale-up or an upgrade's new replicas are still loading. Following /ready to
the letter would take every pod out of the Service for a whole model load whenever Serve adds a
replica, which is the outage the surge upgrade exists to avoid.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

AGENT_PORT = 52365  # Ray's default dashboard-agent-listen-port, as KubeRay's probes assume
SERVE_PORT = 8000


def fetch(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (localhost only)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def can_serve(status: int, body: bytes) -> bool:
    """The decision on /ready's answer (router.api: {"ready", "replicas": {state: n}, "draining"})."""
    if status == 200:
        return True
    try:
        detail = json.loads(body)
    except ValueError:
        return False
    if not isinstance(detail, dict) or detail.get("draining"):
        return False
    replicas = detail.get("replicas") or {}
    return status == 503 and isinstance(replicas, dict) and (replicas.get("RUNNING") or 0) > 0


def check(serve_port: int = SERVE_PORT, agent_port: int = AGENT_PORT, host: str = "127.0.0.1",
          timeout_s: float = 2.0) -> str | None:
    """None when ready, else why not."""
    for url in (f"http://{host}:{agent_port}/api/local_raylet_healthz", f"http://{host}:{serve_port}/-/healthz"):
        try:
            status, body = fetch(url, timeout_s)
        except OSError as e:
            return f"{url}: {e}"
        if status != 200 or b"success" not in body:
            return f"{url}: {status} {body[:200]!r}"
    url = f"http://{host}:{serve_port}/ready"
    try:
        status, body = fetch(url, timeout_s)
    except OSError as e:
        return f"{url}: {e}"
    return None if can_serve(status, body) else f"{url}: {status} {body[:200]!r}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-port", type=int, default=SERVE_PORT)
    p.add_argument("--agent-port", type=int, default=AGENT_PORT)
    p.add_argument("--timeout-s", type=float, default=2.0)
    a = p.parse_args(argv)
    why = check(a.serve_port, a.agent_port, timeout_s=a.timeout_s)
    if why:
        print(f"not ready: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
