"""cluster.probe, the serve pods' readiness: KubeRay's own checks, then the app's /ready, against a
stand-in HTTP server on 127.0.0.1 (the real Ray answers are checked in tests/test_deploy_cluster.py)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cluster import probe


@pytest.mark.parametrize("status, body, ready", [
    (200, {"ready": True, "replicas": {"RUNNING": 2}}, True),
    (503, {"ready": False, "replicas": {"RUNNING": 1, "STARTING": 1}}, True),  # a surge or a scale-up loading
    (503, {"ready": False, "replicas": {"STARTING": 1}}, False),  # nothing loaded yet
    (503, {"ready": False, "replicas": {}}, False),  # the app is not deployed
    (503, {"ready": False, "draining": True}, False),  # shutting down
    (503, {"ready": False, "draining": True, "replicas": {"RUNNING": 1}}, False),
    (404, {"detail": "Not Found"}, False),
])
def test_ready_decision(status, body, ready):
    assert probe.can_serve(status, json.dumps(body).encode()) is ready
    assert probe.can_serve(503, b"<html>proxy error</html>") is False


class Answers(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes]] = {}

    def do_GET(self):
        status, body = self.routes.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_probe_needs_raylet_proxy_and_ready(server):
    ok = {"/api/local_raylet_healthz": (200, b"success"), "/-/healthz": (200, b"success"),
          "/ready": (503, json.dumps({"ready": False, "replicas": {"RUNNING": 1, "STARTING": 1}}).encode())}
    Answers.routes = dict(ok)
    assert probe.check(server, server) is None
    assert probe.main(["--serve-port", str(server), "--agent-port", str(server)]) == 0
    for path, answer in [("/api/local_raylet_healthz", (503, b"raylet dead")), ("/-/healthz", (503, b"draining")),
                         ("/ready", (503, b'{"ready": false, "replicas": {"STARTING": 1}}'))]:
        Answers.routes = {**ok, path: answer}
        why = probe.check(server, server)
        assert why and path in why
    assert probe.check(server, 1) is not None  # nothing listens on port 1
