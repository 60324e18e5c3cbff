"""A real `kvserve serve` process for the reliability suite, and what the tests measure it with.

    ServeProcess      `python -m cluster.cli serve ...` in its own session, on free 127.0.0.1
                      ports, with its own Ray temp dir; stop() leaves no process behind
    scrape / Metrics  the engine's gauges and counters from Ray's Prometheus endpoint
                      (`--metrics-export-port`), as workers/metrics.py names them
    stream_completion one SSE stream, classified: completed / refused (503 + Retry-After) /
                      failed, each bounded in time
    count(...)        a load size from the environment: RELIABILITY_<NAME>, else the full size
                      under RELIABILITY_SCALE=full (`make reliability`), else the small default
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
FULL = os.environ.get("RELIABILITY_SCALE", "default") == "full"


def count(name: str, default: int, full: int) -> int:
    """RELIABILITY_<NAME> if set, else `full` under RELIABILITY_SCALE=full, else `default`."""
    value = os.environ.get(f"RELIABILITY_{name.upper()}")
    return int(value) if value else (full if FULL else default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`kvserve serve` with `args` (besides --port, --device cpu and --metrics-export-port, which
    this sets). Its stdout and stderr, which carry the Ray workers' logs too, go to `log_path`;
    the Ray session's own log files live under `ray_tmp`."""

    READY_TIMEOUT_S = 300.0

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.api_key = api_key
        self.started_s = 0.0
        self._fresh()

    def _fresh(self) -> None:
        """New ports and a new Ray temp dir, for a (re)start."""
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A short path: Ray's unix sockets live under it (108-byte limit). Our own dir, so no other
        # Ray session on this machine is ever read or touched.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="kvrel", dir="/tmp"))
        self.proc: subprocess.Popen | None = None
        self._seen: dict[int, psutil.Process] = {}  # every descendant ever seen, to reap at stop()

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> ServeProcess:
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--metrics-export-port", str(self.metrics_port), *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KVSERVE_API_KEY")}
        env.update(PYTHONPATH=str(ROOT), RAY_TMPDIR=str(self.ray_tmp), PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        deadline = t0 + self.READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.descendants()
            if b"kvserve: ready" in self.log_path.read_bytes():
                self.started_s = time.monotonic() - t0
                return self
            if self.proc.poll() is not None:
                tail = self.log_tail()
                kind = RetryableStart if any(m in tail for m in RetryableStart.MARKS) else RuntimeError
                raise kind(f"kvserve serve exited with {self.proc.returncode} before it was ready:\n{tail}")
            time.sleep(0.25)
        raise RuntimeError(f"kvserve serve not ready within {self.READY_TIMEOUT_S:g}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (kvserve drains, then stops Ray), then SIGKILL for the process group and for every
        descendant ever seen; waits until all are gone."""
        if self.proc is None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            return
        self.descendants()
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if self.proc.poll() is None:
                with _ignore_gone():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            procs = list(self._seen.values())
            _, alive = psutil.wait_procs(procs, timeout=20)
            for p in alive:  # a Ray process that left the session: ours all the same, by pid
                with _ignore_gone():
                    p.kill()
            psutil.wait_procs(alive, timeout=10)
            shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self) -> ServeProcess:
        try:
            return self.start()
        except RetryableStart:  # not kvserve's doing: try once more, on new ports
            self.stop(timeout_s=5)
            self._fresh()
        except BaseException:
            self.stop(timeout_s=5)
            raise
        try:
            return self.start()
        except BaseException:
            self.stop(timeout_s=5)
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- processes ---------------------------------------------------------------------------------
    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            self._seen.setdefault(p.pid, p)
        return found

    def procs_named(self, *parts: str) -> list[psutil.Process]:
        """Live descendants whose process title holds every one of `parts` (Ray names its workers
        `ray::ServeReplica:kvserve:EngineServer`, `ray::RankWorker`, ...)."""
        out = []
        for p in self.descendants():
            try:
                title = " ".join(p.cmdline()) or p.name()
            except psutil.Error:
                continue
            if all(part in title for part in parts):
                out.append(p)
        return out

    def engine_replicas(self) -> list[psutil.Process]:
        return self.procs_named("ServeReplica", "EngineServer")

    def rank_workers(self) -> list[psutil.Process]:
        return self.procs_named("RankWorker")

    # -- logs --------------------------------------------------------------------------------------
    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def log_files(self) -> list[Path]:
        """The serve process's output plus every file of its Ray session (worker logs, ...)."""
        files = [self.log_path]
        files += [p for p in self.ray_tmp.rglob("*") if p.is_file() and not p.is_symlink()]
        return files

    def logs_containing(self, needle: str) -> list[str]:
        hits, data = [], needle.encode()
        for path in self.log_files():
            try:
                if path.stat().st_size < 64 << 20 and data in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
        return hits

    # -- HTTP --------------------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, want: int = 200, timeout_s: float = 120.0) -> float | None:
        """Poll /ready until it answers `want`; the monotonic time it did, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == want:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return None

    # -- metrics -----------------------------------------------------------------------------------
    def scrape(self) -> Metrics:
        r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
        r.raise_for_status()
        return Metrics.parse(r.text)

    def wait_engine_idle(self, timeout_s: float = 60.0) -> Metrics:
        """Scrape until the engine gauges read no request running or waiting and no KV block in
        use, twice in a row (they are refreshed every second and pushed by Ray every second);
        returns the last scrape (the caller asserts on it, so a pool that stays dirty is seen)."""
        deadline = time.monotonic() + timeout_s
        clean_in_a_row, m = 0, None
        while time.monotonic() < deadline:
            m = self.scrape()
            clean = m.has_engine_gauges() and m.engine_running() == 0 and m.engine_waiting() == 0 \
                and m.kv_usage() == 0
            clean_in_a_row = clean_in_a_row + 1 if clean else 0
            if clean_in_a_row >= 2:
                return m
            time.sleep(1.0)
        return m


class RetryableStart(RuntimeError):
    """A start that failed for the machine's sake: a port picked as free was taken before kvserve
    bound it, or Ray's raylet did not register within Ray's fixed 30 s on an overloaded host."""

    MARKS = ("cannot listen on", "Address already in use", "The current node timed out during startup")


class _ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, psutil.NoSuchProcess))


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Metrics:
    """One scrape of Ray's Prometheus endpoint: (name, labels, value) samples."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m:
                out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
        return cls(out)

    def values(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples
                if n == name and all(lab.get(k) == want for k, want in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        return sum(v for _, v in self.values(name, **labels))

    def has_engine_gauges(self) -> bool:
        return bool(self.values("ray_kvserve_kv_cache_usage_perc"))

    def engine_running(self) -> float:
        return self.total("ray_kvserve_num_requests_running")

    def engine_waiting(self) -> float:
        return self.total("ray_kvserve_num_requests_waiting")

    def kv_usage(self) -> float:
        return self.total("ray_kvserve_kv_cache_usage_perc")

    def finished(self, reason: str) -> float:
        return self.total("ray_kvserve_request_success_total", finished_reason=reason)

    def preemptions(self) -> float:
        return self.total("ray_kvserve_num_preemptions_total")


# -- clients -----------------------------------------------------------------------------------------
COMPLETED, REFUSED, FAILED, CANCELLED = "completed", "refused", "failed", "cancelled"


@dataclass
class StreamResult:
    outcome: str  # completed | refused | failed | cancelled
    status: int | None = None
    events: int = 0  # data events before [DONE]
    finish_reason: str | None = None
    detail: str = ""


def classify_refusal(status: int, headers, body: bytes) -> StreamResult:
    """A 503 (or 429) with Retry-After >= 1 and an OpenAI error body is a refusal; else a failure."""
    try:
        error = json.loads(body)["error"]
        retry_after = int(headers.get("retry-after", "0"))
    except (ValueError, KeyError, TypeError):
        return StreamResult(FAILED, status, detail=body[:300].decode(errors="replace"))
    if status in (429, 503) and retry_after >= 1 and error.get("code") in ("queue_full", "unavailable"):
        return StreamResult(REFUSED, status, detail=error.get("code"))
    return StreamResult(FAILED, status, detail=body[:300].decode(errors="replace"))


async def stream_request(client: httpx.AsyncClient, url: str, path: str, body: dict, timeout_s: float,
                         cancel_after_events: int | None = None, headers: dict | None = None) -> StreamResult:
    """POST a `stream: true` request and read its SSE events. Completed: 200, one or more chunks,
    the last with a finish_reason on every choice it names, then `data: [DONE]`, no error event.
    With `cancel_after_events`, the client disconnects after that many events (cancelled), unless
    the stream ended first."""
    async def run() -> StreamResult:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                return classify_refusal(r.status_code, r.headers, await r.aread())
            events: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if events[-1] == "[DONE]":
                    break
                if cancel_after_events is not None and len(events) >= cancel_after_events:
                    return StreamResult(CANCELLED, 200, len(events))  # leaving `async with` closes the socket
            return check_sse(events)

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        return StreamResult(FAILED, detail=f"no end within {timeout_s:g}s")
    except httpx.HTTPError as e:
        return StreamResult(FAILED, detail=f"{type(e).__name__}: {e}")


def drop_stream(url: str, path: str, body: dict, after_events: int, timeout_s: float,
                headers: dict | None = None) -> StreamResult:
    """POST a `stream: true` request over a plain socket and hang up after `after_events` SSE
    events, unless the stream had already ended by then. "Already ended" is decided on every byte
    the server had sent at that moment: before hanging up, the client takes whatever its kernel
    holds for it without waiting, so a client that fell behind (a busy host) is not mistaken for
    one that left mid-stream. Cancelled: it left while the server was still sending."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    deadline = time.monotonic() + timeout_s
    received, server_closed = b"", False
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        while received.count(b"data: ") < after_events and b"data: [DONE]" not in received:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, OSError) as e:
                return StreamResult(FAILED, detail=f"{type(e).__name__} after {received[-300:]!r}")
            if not chunk:
                server_closed = True
                break
            received += chunk
        head_bytes, _, rest = received.partition(b"\r\n\r\n")
        status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
        if status != 200:
            got = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
            return classify_refusal(status, got, rest)
        sock.setblocking(False)
        while True:  # what had already arrived when the client decided to leave
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                break
            if not chunk:
                server_closed = True
                break
            received += chunk
    events = received.count(b"data: ")
    if b"data: [DONE]" in received:
        return StreamResult(COMPLETED, 200, events - 1)
    if server_closed:  # the server hung up without [DONE]: cut, not left
        return StreamResult(FAILED, 200, events, detail=f"closed without [DONE]: {received[-300:]!r}")
    return StreamResult(CANCELLED, 200, events)


def check_sse(events: list[str]) -> StreamResult:
    if not events or events[-1] != "[DONE]":
        return StreamResult(FAILED, 200, len(events), detail=f"no [DONE]; last events {events[-2:]}")
    chunks = []
    for e in events[:-1]:
        try:
            chunks.append(json.loads(e))
        except ValueError:
            return StreamResult(FAILED, 200, len(events), detail=f"not JSON: {e[:200]}")
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return StreamResult(FAILED, 200, len(chunks), detail=f"error event {errors[0]}")
    with_choices = [c for c in chunks if c.get("choices")]
    if not with_choices:
        return StreamResult(FAILED, 200, len(chunks), detail="no chunk with a choice")
    reasons: dict[int, str | None] = {}
    for c in with_choices:
        for choice in c["choices"]:
            if choice.get("finish_reason") is not None or choice["index"] not in reasons:
                reasons[choice["index"]] = choice.get("finish_reason")
    if any(r is None for r in reasons.values()):
        return StreamResult(FAILED, 200, len(chunks), detail=f"a choice ended without finish_reason: {reasons}")
    return StreamResult(COMPLETED, 200, len(chunks), finish_reason=",".join(sorted(set(reasons.values()))))


def async_client(max_connections: int = 1024, headers: dict | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=max_connections),
                             timeout=httpx.Timeout(600.0, connect=30.0), headers=headers)


def proc_usage(p: psutil.Process) -> tuple[int, int]:
    """(RSS bytes, open fds) of one process."""
    with p.oneshot():
        return p.memory_info().rss, p.num_fds()
