"""The deploy/k8s profiles run unchanged on a multi-node local Ray, as KubeRay runs them (slow:
minutes; `make deploy-proof`, i.e. pytest -m deploy_proof; skipped otherwise).

For each profile's RayService: a head started with the manifest's rayStartParams and pod limits
(`ray start --head --num-cpus 0 --memory ...`) and one node per worker pod (`ray start --address
... --num-cpus N --memory M --num-gpus G`), every one with Ray token auth on (RAY_AUTH_MODE=token
and a token, as KubeRay's authOptions sets them) and the API key in its environment (as the
Secret does). Then, as the KubeRay operator would: the serveConfigV2 PUT to the dashboard's Serve
REST API, changing nothing but the HTTP port (the GPU profiles also get `device: cpu` and a tiny
model from tests/tiny_llama.py); KubeRay's probe URLs; /ready; a chat completion; every metric
the Grafana dashboard charts on a node's metrics port; the config changed (max_num_seqs) and PUT
again while clients stream, with no failed request; the dashboard's Serve API listing the app.

What differs from a cluster, and why: all nodes share 127.0.0.1, so each node gets its own free
ports (GCS, dashboard, agent, metrics; a worker's Serve proxy via RAY_SERVE_WORKER_PROXY_HTTP_PORT,
which is what port 8000 in its own pod network would be), the dashboard binds 127.0.0.1 instead of
0.0.0.0, and each node's object store is capped at 256 MB (a shared 2-core machine). Every process
started here is stopped by process id at the end (never `ray stop`, which would also stop any
other Ray on this machine).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
import yaml

from tests.local_serve import free_port
from tests.test_deploy_manifests import K8S, PROFILE_SERVICE, pod_groups, quantity, ray_container, serve_config

pytestmark = pytest.mark.deploy_proof
RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE_BYTES = 256 * 2**20
TINY_TP8 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(autouse=True, scope="module")
def _only_when_asked(request):
    if "deploy_proof" not in (request.config.option.markexpr or ""):
        pytest.skip("slow (minutes, several Ray nodes): `make deploy-proof` runs it (pytest -m deploy_proof)")


def log(msg: str) -> None:
    print(f"[deploy-proof {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- processes: started here, stopped here, by id -----------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time) for every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = (int(fields[1]), fields[19])
    return out


def _descendants(roots: set[int]) -> dict[int, str]:
    table, found, frontier = _proc_table(), {}, set(roots)
    while frontier:
        found.update({p: table[p][1] for p in frontier if p in table})
        frontier = {p for p, (pp, _) in table.items() if pp in frontier and p not in found}
    return found


class LocalKubeRay:
    """One Ray node per pod of a RayService's rayClusterConfig, on 127.0.0.1."""

    def __init__(self, doc: dict, env: dict[str, str]) -> None:
        self.doc, self.env = doc, env
        self.temp = tempfile.mkdtemp(prefix="kvd", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[dict] = []  # {"name", "agent_port", "metrics_port", "serve_port"}
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.http_port = free_port()

    def _start(self, name: str, group: dict, head: bool) -> None:
        params, limits = dict(group.get("rayStartParams", {})), ray_container(group)["resources"]["limits"]
        node = {"name": name, "agent_port": free_port(), "metrics_port": free_port()}
        args = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--temp-dir", self.temp,
                "--disable-usage-stats", "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--dashboard-agent-listen-port", str(node["agent_port"]), "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(node["metrics_port"]),
                # What KubeRay's generated `ray start` passes from the pod's limits, unless rayStartParams say.
                "--num-cpus", params.pop("num-cpus", str(int(quantity(limits["cpu"])))),
                "--memory", str(int(quantity(limits["memory"]))),
                "--num-gpus", str(int(quantity(limits.get("nvidia.com/gpu", 0))))]
        assert params.pop("metrics-export-port", "8080")  # each node has its own port here
        env = dict(self.env)
        if head:
            params.pop("dashboard-host", None)  # 0.0.0.0 in the pod; loopback here
            args += ["--head", "--port", str(self.gcs_port), "--dashboard-host", "127.0.0.1",
                     "--dashboard-port", str(self.dashboard_port), "--ray-client-server-port", str(free_port())]
            node["serve_port"] = self.http_port
        else:
            args += ["--address", f"127.0.0.1:{self.gcs_port}"]
            node["serve_port"] = free_port()
            env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(node["serve_port"])  # its pod's own port 8000
        assert not params, f"rayStartParams this proof does not map: {params}"
        with open(Path(self.temp) / f"ray-start-{name}.log", "w") as out:  # Ray's own logs: <temp>/session_latest/logs
            self.procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        self.nodes.append(node)

    def __enter__(self) -> "LocalKubeRay":
        try:
            groups = list(pod_groups(self.doc))
            self._start(*groups[0], head=True)
            wait_for(lambda: get(f"{self.dashboard}/api/gcs_healthz").status_code == 200, 120, "head up")
            for name, group in groups[1:]:
                for _ in range(group.get("replicas", group.get("minReplicas", 1))):
                    self.add_worker(name, group)
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, name: str, group: dict) -> dict:
        """One more pod of this worker group, as KubeRay's autoscaler would add it."""
        self._start(f"{name}-{sum(n['name'].startswith(name + '-') for n in self.nodes)}", group, head=False)
        node, proc = self.nodes[-1], self.procs[-1]

        def up() -> bool:
            assert proc.poll() is None, f"{node['name']}: ray start exited ({self.temp}/ray-start-{node['name']}.log)"
            return b"success" in get(f"http://127.0.0.1:{node['agent_port']}/api/local_raylet_healthz").content
        wait_for(up, 300, f"{node['name']} raylet up")  # minutes when the machine is busy
        return node

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def stop(self) -> None:
        """SIGTERM to the `ray start --block` process groups started here (each stops its node's
        processes), then SIGKILL to whatever is left of their process trees or uses this temp dir."""
        tree = _descendants({p.pid for p in self.procs})
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        table = _proc_table()
        left = {pid for pid, start in tree.items() if pid in table and table[pid][1] == start}
        for pid in table:
            with contextlib.suppress(OSError):
                if self.temp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    left.add(pid)
        for pid in left - {os.getpid()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self.killed_after_term = len(left)


def get(url: str, **kw) -> httpx.Response:
    try:
        return httpx.get(url, timeout=kw.pop("timeout", 5), **kw)
    except httpx.HTTPError as e:
        return httpx.Response(599, text=f"{type(e).__name__}: {e}")


def wait_for(cond, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = cond()
        except AssertionError:  # a definite failure, not "not yet"
            raise
        except Exception:  # not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(period_s)


# -- the profile's app, as the operator submits it ----------------------------------------------------
def profile_config(profile: str, http_port: int, tiny: dict[str, Path]) -> dict:
    config = serve_config(PROFILE_SERVICE[profile])
    config["http_options"]["port"] = http_port
    if profile.startswith("gpu"):
        (app,) = config["applications"]
        tp = app["args"]["tensor_parallel_size"]
        app["args"].update(model=str(tiny[tp]), device="cpu")
    return config


def app_status(cluster: LocalKubeRay, token: str) -> dict:
    r = get(f"{cluster.dashboard}/api/serve/applications/", headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return r.json()["applications"].get("kvserve") or {}


def engine_deployment(status: dict) -> dict:
    return status.get("deployments", {}).get("EngineServer", {})


def running_replicas(status: dict) -> int:
    return sum(r.get("state") == "RUNNING" for r in engine_deployment(status).get("replicas", []))


def charted_metrics() -> set[str]:
    dash = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "text" for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\b(ray_\w+)\s*(?=[{\[)])", e)}


def exported(cluster: LocalKubeRay) -> set[str]:
    names = set()
    for node in cluster.nodes:
        for line in get(f"http://127.0.0.1:{node['metrics_port']}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, 1)[0])
    return names


class Streamers:
    """Clients streaming chat completions one after another until stopped (bounded in count and time)."""

    def __init__(self, url: str, key: str, model: str, n: int = 2, max_requests: int = 400, max_s: float = 600) -> None:
        self.url, self.key, self.model = url, key, model
        self.results: list[dict] = []
        self.stop = threading.Event()
        self.max_requests, self.deadline = max_requests, time.monotonic() + max_s
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _one(self, client: httpx.Client) -> dict:
        t0, chunks, done, error = time.monotonic(), 0, False, None
        body = {"model": self.model, "messages": [{"role": "user", "content": "Count to ten."}],
                "max_tokens": 12, "stream": True}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]
                        chunks += 1
                if status != 200:
                    error = error or r.read().decode(errors="replace")[:200]
        except httpx.HTTPError as e:
            status, error = 599, f"{type(e).__name__}: {e}"
        return {"t0": t0, "t1": time.monotonic(), "status": status, "done": done, "chunks": chunks, "error": error}

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {self.key}"}) as c:
            while not self.stop.is_set() and len(self.results) < self.max_requests and time.monotonic() < self.deadline:
                self.results.append(self._one(c))

    def __enter__(self) -> "Streamers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if r["status"] != 200 or not r["done"] or r["error"]]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_path) -> dict[int, Path]:
    """tensor_parallel_size -> a tiny random Llama that splits that many ways, with SmolLM2's
    tokenizer (and its vocabulary size, so that chat prompts tokenize into it)."""
    from transformers import AutoTokenizer

    from tests import tiny_llama

    vocab = len(AutoTokenizer.from_pretrained(smollm2_path))
    root = tmp_path_factory.mktemp("deploy-proof-models")
    with mock.patch.dict(tiny_llama.TINY_CONFIGS, {"tp8": TINY_TP8}):
        return {2: tiny_llama.make_tiny_llama(root / "tp2", smollm2_path, "gqa", vocab_size=vocab),
                8: tiny_llama.make_tiny_llama(root / "tp8", smollm2_path, "tp8", vocab_size=vocab)}


def pods_for_surge(profile: str, config: dict, local: LocalKubeRay) -> list[tuple[str, dict]]:
    """The worker pods the autoscaler would add so that the running replicas plus the surging
    ones fit (cluster.sizing's count of replicas per pod)."""
    from cluster import app, sizing
    from engine.model.loader import load_arch
    from engine.model_source import resolve_model
    from tests.test_deploy_manifests import node_shapes

    engine, options = app.split_args(config["applications"][0]["args"])
    model_dir = resolve_model(engine.model)
    arch = load_arch(model_dir)[0]
    needs = sizing.replica_needs(engine, arch, sizing.checkpoint_bytes(model_dir, arch), app.use_gpu(engine))
    ((group, shape),) = node_shapes(PROFILE_SERVICE[profile])
    target = options.num_replicas or options.min_replicas
    want = target + -(-options.max_surge_percent * target // 100)
    pods = -(-want // sizing.replicas_per_node(needs, shape))
    return [(group["groupName"], group)] * max(0, pods - (len(local.nodes) - 1))


def longest_failing_s(samples: list[tuple[float, int]]) -> float:
    """The longest time from a failed probe to the next passing one."""
    longest, since = 0.0, None
    for t, rc in samples:
        if rc and since is None:
            since = t
        elif not rc and since is not None:
            longest, since = max(longest, t - since), None
    return longest if since is None else float("inf")


def replica_rss_bytes(local: LocalKubeRay) -> list[int]:
    """RSS of this cluster's engine replica processes (not another Ray's on the same machine)."""
    out = []
    for pid in _descendants({p.pid for p in local.procs}):
        d = Path(f"/proc/{pid}")
        with contextlib.suppress(OSError):
            if (d / "cmdline").read_bytes().startswith(b"ray::ServeReplica:kvserve:EngineServer"):
                rss = re.search(r"VmRSS:\s+(\d+) kB", (d / "status").read_text())
                out.append(int(rss.group(1)) * 1024)
    return out


@pytest.mark.parametrize("profile", ["cpu", "gpu-8b-tp2", "gpu-70b-tp8"])
def test_profile_runs_on_a_multi_node_ray_as_kuberay_runs_it(profile, tiny_models, tmp_path):
    token, key = secrets.token_urlsafe(32), "sk-" + secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "KVSERVE_API_KEY": key,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    report: dict = {"profile": profile}
    t_start = time.monotonic()
    with LocalKubeRay(PROFILE_SERVICE[profile], env) as cluster:
        report["nodes_up_s"] = round(time.monotonic() - t_start, 1)
        log(f"{profile}: {len(cluster.nodes)} Ray nodes up in {report['nodes_up_s']} s")
        auth = {"Authorization": f"Bearer {token}"}
        apps_url = f"{cluster.dashboard}/api/serve/applications/"
        # Token auth: the dashboard's REST API refuses a caller without the token; KubeRay's probes need none.
        report["serve_api_without_token"] = get(apps_url).status_code
        assert report["serve_api_without_token"] == 401
        assert get(apps_url, headers=auth).status_code == 200

        config = profile_config(profile, cluster.http_port, tiny_models)
        t0 = time.monotonic()
        r = httpx.put(apps_url, json=config, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        wait_for(lambda: app_status(cluster, token).get("status") == "RUNNING", 600, "the app RUNNING", 1.0)
        report["deploy_s"] = round(time.monotonic() - t0, 1)
        log(f"{profile}: app RUNNING {report['deploy_s']} s after the PUT")

        # KubeRay's probe URLs: head (dashboard gcs_healthz, agent healthz), every node's agent
        # local_raylet_healthz, every worker's proxy /-/healthz; then cluster.probe, our readiness.
        head, workers = cluster.nodes[0], cluster.nodes[1:]
        # Each URL must answer 200 within 30 s, as KubeRay's probes retry (failureThreshold 10 for
        # readiness, 120 for liveness); the number of tries is recorded (a loaded machine can 503 once).
        tries: dict[str, int] = {}

        def probe_url(name: str, url: str) -> int:
            def ok() -> int:
                tries[name] = tries.get(name, 0) + 1
                return get(url).status_code == 200 and 200
            return wait_for(ok, 30, name, 1.0)

        probes = {"head gcs_healthz": probe_url("head gcs_healthz", f"{cluster.dashboard}/api/gcs_healthz"),
                  "head agent healthz": probe_url("head agent healthz", f"http://127.0.0.1:{head['agent_port']}/api/healthz")}
        for n in cluster.nodes:
            probes[f"{n['name']} local_raylet_healthz"] = probe_url(
                f"{n['name']} local_raylet_healthz", f"http://127.0.0.1:{n['agent_port']}/api/local_raylet_healthz")
        for n in workers:
            probes[f"{n['name']} proxy /-/healthz"] = wait_for(
                lambda n=n: get(f"http://127.0.0.1:{n['serve_port']}/-/healthz").status_code == 200 and 200, 60,
                f"{n['name']} proxy")
            rc = subprocess.run([sys.executable, "-m", "cluster.probe", "--serve-port", str(n["serve_port"]),
                                 "--agent-port", str(n["agent_port"])], env=env, capture_output=True, text=True, timeout=30)
            probes[f"{n['name']} cluster.probe"] = rc.returncode
            assert rc.returncode == 0, rc.stderr
        report["probes"] = probes
        report["probe_tries"] = {k: v for k, v in tries.items() if v > 1}
        assert all(v in (0, 200) for v in probes.values()), probes
        base = f"http://127.0.0.1:{cluster.http_port}"
        ready = get(f"{base}/ready")
        report["ready"] = [ready.status_code, ready.json()]
        assert ready.status_code == 200

        # Metrics from the start: every kvserve counter and gauge before any request.
        charted = charted_metrics()
        kvserve_from_start = {m for m in charted if m.startswith("ray_kvserve_") and not m.endswith("_bucket")}
        t0 = time.monotonic()
        wait_for(lambda: kvserve_from_start <= exported(cluster), 60, f"{sorted(kvserve_from_start)} exported", 2.0)
        report["kvserve_counters_and_gauges_exported_s"] = round(time.monotonic() - t0, 1)

        model = config["applications"][0]["args"].get("served_model_name") or "SmolLM2-135M-Instruct"
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{base}/v1/chat/completions", json={"model": model, "messages": []}, timeout=30).status_code == 401
        r = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        report["chat_completion"] = {"status": r.status_code, "usage": r.json()["usage"]}
        assert httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=30,
                          json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}).status_code == 404
        expected_absent = {"ray_node_gpus_utilization"}  # no GPU here
        if "autoscaling_config" not in json.dumps(config) and "autoscale" not in config["applications"][0]["args"]:
            expected_absent |= {m for m in charted if "autoscaling" in m}  # a fixed replica count
        t0 = time.monotonic()
        wait_for(lambda: charted - expected_absent <= exported(cluster), 90, "every charted metric", 2.0)
        report["charted_metrics"] = {"charted": len(charted), "absent_by_design": sorted(expected_absent & charted),
                                     "exported_s_after_first_request": round(time.monotonic() - t0, 1)}
        report["replica_rss_mib"] = [b // 2**20 for b in replica_rss_bytes(cluster)]

        # A config change while clients stream: max_num_seqs halves; the new replica must start
        # before the old one stops (max_surge_percent), and no request may fail. Where the surging
        # replica fits no running pod (TP8: 9 CPUs, one replica per 16-CPU pod), one more pod joins
        # first, as KubeRay's autoscaler adds it for the pending placement group
        # (tests/test_deploy_autoscaler.py shows it does, up to maxReplicas).
        surge_pods = pods_for_surge(profile, config, cluster)
        for name, group in surge_pods:
            cluster.add_worker(name, group)
        report["pods_added_for_the_surge"] = len(surge_pods)
        (app,) = config["applications"]
        old_seqs = app["args"]["max_num_seqs"]
        app["args"]["max_num_seqs"] = new_seqs = max(1, old_seqs // 2)
        ready_codes, probe_codes, ready_bodies, probe_why = [], [], set(), []
        with Streamers(base, key, model) as clients:
            wait_for(lambda: len(clients.results) >= 4, 120, "clients streaming")
            t0 = time.monotonic()
            r = httpx.put(apps_url, json=config, headers=auth, timeout=30)
            assert r.status_code == 200, r.text

            def upgraded() -> bool:
                r = get(f"{base}/ready")
                ready_codes.append(r.status_code)
                if r.status_code != 200:
                    ready_bodies.add(r.text[:200])
                # The Service has endpoints while any serve pod is Ready. A pod whose replica moved
                # away is drained by Serve ("This node is being drained") and leaves, as it should.
                codes = []
                for n in cluster.nodes[1:]:
                    p = subprocess.run([sys.executable, "-m", "cluster.probe", "--serve-port", str(n["serve_port"]),
                                        "--agent-port", str(n["agent_port"])], env=env, capture_output=True,
                                       text=True, timeout=30)
                    codes.append(p.returncode)
                    if p.returncode:
                        probe_why.append(f"{n['name']}: {p.stderr.strip()[-300:]}")
                probe_codes.append((time.monotonic(), int(all(codes))))
                s = app_status(cluster, token)
                d = engine_deployment(s)
                return (s.get("status") == "RUNNING" and d.get("deployment_config", {}).get("max_ongoing_requests") == new_seqs
                        and all(r.get("state") == "RUNNING" for r in d.get("replicas", [])))

            wait_for(upgraded, 600, "the upgrade", 1.0)
            report["upgrade_s"] = round(time.monotonic() - t0, 1)
            n_before = len(clients.results)
            wait_for(lambda: len(clients.results) >= n_before + 4, 120, "requests after the upgrade")
        report["upgrade_requests"] = {"total": len(clients.results), "failed": len(clients.failed),
                                      "during": sum(r["t1"] >= t0 and r["t0"] <= t0 + report["upgrade_s"] for r in clients.results),
                                      "ready_codes": {c: ready_codes.count(c) for c in set(ready_codes)},
                                      "ready_503_bodies": sorted(ready_bodies), "probe_checks": len(probe_codes),
                                      "no_pod_ready": sum(rc != 0 for _, rc in probe_codes),
                                      "probe_longest_not_ready_s": round(longest_failing_s(probe_codes), 1),
                                      "pods_not_ready_at_the_end": sorted({w.split(":")[0] for w in probe_why[-len(cluster.nodes):]}),
                                      "probe_why": sorted(set(probe_why))}
        log(f"{profile}: upgrade in {report['upgrade_s']} s: {report['upgrade_requests']}")
        report["upgrade_failures"] = [{k: r[k] for k in ("status", "done", "chunks", "error")} | {"s": round(r["t1"] - r["t0"], 1)}
                                      for r in clients.failed]
        assert not clients.failed, json.dumps(report["upgrade_failures"])
        probe = ray_container(PROFILE_SERVICE[profile]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0])["readinessProbe"]
        tolerated_s = probe["periodSeconds"] * (probe["failureThreshold"] - 1)
        assert report["upgrade_requests"]["probe_longest_not_ready_s"] < tolerated_s, \
            "no serve pod was Ready long enough for the Service to lose every endpoint"

        # The dashboard's Serve page API lists the app and its deployments.
        status = app_status(cluster, token)
        report["dashboard_serve_api"] = {name: d["status"] for name, d in status["deployments"].items()}
        expected = {"OpenAIIngress": "HEALTHY", "EngineServer": "HEALTHY"}
        args = status["deployed_app_config"]["args"]
        if args.get("num_ingress_replicas", 1) > 1 or args.get("ingress_autoscaling_config"):
            expected["ResponseStore"] = "HEALTHY"  # stored /v1/responses, shared by the ingress replicas
        assert report["dashboard_serve_api"] == expected
        assert status["deployed_app_config"]["args"]["max_num_seqs"] == new_seqs
    report["stopped_processes_needing_sigkill"] = cluster.killed_after_term
    report["total_s"] = round(time.monotonic() - t_start, 1)
    log(f"{profile}: {json.dumps(report)}")
    out = os.environ.get("KVSERVE_DEPLOY_PROOF_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(report) + "\n")
