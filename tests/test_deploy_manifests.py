"""deploy/k8s: manifests that KubeRay accepts and that deploy our real application.

No cluster and no running Ray: RayService / RayCluster documents are validated against the
openAPIV3Schema of KubeRay's CRDs (../shared/kuberay-crds), closed to unknown fields as
`kubectl apply`'s strict field validation is; serveConfigV2 against Serve's own config schema,
then its import_path is imported and its args go through cluster.app.build_app (with only the
model-directory check stubbed out, since the models live on the cluster's volume); the
monitoring files against the metric and deployment names that really exist (Ray's own, and
ours from workers.metrics).
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CRDS = ROOT.parent / "shared" / "kuberay-crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
GPU = "nvidia.com/gpu"


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if d is not None]


MANIFESTS = sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*.yml"))
DOCS = [(p.name, d) for p in MANIFESTS for d in load_all(p)]
RAY_DOCS = [(f, d) for f, d in DOCS if d.get("apiVersion") == "ray.io/v1"]
RAY_SERVICES = [(f, d) for f, d in RAY_DOCS if d["kind"] == "RayService"]


def doc_id(item) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


# -- KubeRay CRD schemas -------------------------------------------------------------------------------
def closed(schema: dict) -> dict:
    """Reject unknown fields (a typo such as `workerGroupSpec`), as `kubectl apply` does. The CRDs
    leave additionalProperties unset because the API server prunes unknown fields instead."""
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        closed(sub)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            closed(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            closed(sub)
    return schema


@functools.cache
def crd_validator(kind: str):
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {CRDS} (reference data outside the repo; "
                    "present in the development workspace only)")
    (crd,) = load_all(CRDS / CRD_FILES[kind])
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = closed(v1["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    errors = crd_validator(doc["kind"]).iter_errors(doc)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def test_manifests_exist_and_parse():
    assert {"rayservice.yaml", "prometheus-scrape.yaml"} <= {p.name for p in MANIFESTS}
    assert RAY_SERVICES, "no RayService in deploy/k8s"
    for name, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), name


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_ray_documents_match_kuberay_crd(item):
    _, doc = item
    assert doc["kind"] in CRD_FILES, f"no CRD schema for kind {doc['kind']}"
    assert crd_errors(doc) == []


@pytest.mark.parametrize("mutate, expect", [
    (lambda s: s["rayClusterConfig"].__setitem__("workerGroupSpec", []), "workerGroupSpec"),
    (lambda s: s["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0), "num-cpus"),
    (lambda s: s["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .__setitem__("imagePullPolcy", "Always"), "imagePullPolcy"),
    (lambda s: s["rayClusterConfig"]["headGroupSpec"].pop("template"), "template"),
])
def test_crd_validation_catches_mistakes(mutate, expect):
    doc = copy.deepcopy(RAY_SERVICES[0][1])
    mutate(doc["spec"])
    assert any(expect in e for e in crd_errors(doc))


# -- serveConfigV2 -> our app builder -----------------------------------------------------------------
def serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def resolve(import_path: str):
    """Serve's import_path forms: `module:attr` or `module.attr`."""
    module, _, attr = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def build_without_ray(monkeypatch, args: dict):
    """Run cluster.app.build_app on these args, Ray not started. Only check_args' look at the
    model directory (on the cluster's volume, or converted in the image) is left out."""
    import ray

    import cluster.app

    monkeypatch.setattr(cluster.app, "check_args", cluster.app.split_args)
    app = cluster.app.build_app(args)
    assert not ray.is_initialized()
    return app


@pytest.mark.parametrize("item", RAY_SERVICES, ids=doc_id)
def test_serve_config_deploys_our_app(item, monkeypatch):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    import cluster.app

    config = serve_config(item[1])
    ServeDeploySchema.model_validate(config)  # Serve's own schema for a config file
    assert config["applications"]
    for app in config["applications"]:
        builder = resolve(app["import_path"])
        assert callable(builder)
        assert builder is cluster.app.build_app, f"{app['import_path']}: the args check below knows build_app only"
        args = app.get("args") or {}
        engine, options = cluster.app.split_args(args)  # unknown keys and bad values raise here
        opts = cluster.app.engine_deployment_options(engine, options)
        if "autoscaling_config" in opts:
            policy = AutoscalingConfig(**opts["autoscaling_config"]).policy
            assert callable(resolve(policy.policy_function))
        assert resolve(opts["request_router_config"].request_router_class)
        assert isinstance(build_without_ray(monkeypatch, args), Application)


@pytest.mark.parametrize("path, args", [
    ("cluster.app:build_ap", None),
    ("cluster.ap:build_app", None),
    ("cluster.app:build_app", {"tensor_paralel_size": 2}),
    ("cluster.app:build_app", {"routing": "kv-aware"}),
    ("cluster.app:build_app", {"autoscale": "kv"}),  # kv autoscaling needs max_replicas
])
def test_serve_config_check_catches_mistakes(path, args, monkeypatch):
    with pytest.raises((ImportError, AttributeError, ValueError)):
        resolve(path)
        build_without_ray(monkeypatch, args)


# -- the cluster's shape fits the app -----------------------------------------------------------------
def pod_groups(doc: dict):
    """(group name, group spec) for the head and every worker group."""
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    yield "head", cluster["headGroupSpec"]
    for group in cluster.get("workerGroupSpecs", []):
        yield group.get("groupName", "?"), group


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in the first container


def gpus(group: dict) -> int:
    return int(ray_container(group).get("resources", {}).get("limits", {}).get(GPU, 0))


@pytest.mark.parametrize("item", RAY_SERVICES, ids=doc_id)
def test_worker_groups_fit_the_engine_replicas(item):
    import cluster.app

    doc = item[1]
    groups = dict(pod_groups(doc))
    assert gpus(groups["head"]) == 0, "the head runs the proxy and ingress only"
    assert groups["head"]["rayStartParams"].get("num-cpus") == "0", "keep engine replicas off the head"
    for app in serve_config(doc)["applications"]:
        engine, options = cluster.app.split_args(app.get("args") or {})
        tp, workers = engine.tensor_parallel_size, [g for n, g in groups.items() if n != "head"]
        if engine.device == "cuda":
            gpu_groups = [g for g in workers if gpus(g)]
            assert gpu_groups, "device cuda without a GPU worker group"
            for g in gpu_groups:
                assert gpus(g) % tp == 0, f"{g['groupName']}: {gpus(g)} GPUs per pod do not hold TP groups of {tp}"
            slots = sum(g["maxReplicas"] * (gpus(g) // tp) for g in gpu_groups)
        else:
            assert not any(gpus(g) for g in workers), f"device {engine.device} with GPU pods"
            slots = sum(g["maxReplicas"] * int(ray_container(g)["resources"]["limits"]["cpu"]) for g in workers)
        assert slots >= options.max_engine_replicas, "the worker groups cannot hold max_replicas engine replicas"
        if options.autoscale != "none":
            assert doc["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling"), \
                "Serve autoscaling without KubeRay's autoscaler cannot add pods"


def dockerfiles() -> dict[str, dict]:
    """image tag -> {"path", "ray_version"}, from each Dockerfile's `docker build ... -t TAG` line."""
    out = {}
    for path in sorted(K8S.glob("Dockerfile*")):
        if path.suffix == ".dockerignore":
            continue
        text = path.read_text()
        (tag,) = re.findall(rf"docker build -f deploy/k8s/{re.escape(path.name)} -t (\S+) \.", text)
        (version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
        out[tag] = {"path": path.name, "ray_version": version}
    return out


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_images_come_from_our_dockerfiles_with_the_same_ray(item):
    import ray

    doc, built = item[1], dockerfiles()
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    for name, group in pod_groups(doc):
        image = ray_container(group)["image"]
        assert image in built, f"{name}: image {image} is built by none of {sorted(built)}"
        assert cluster["rayVersion"] == built[image]["ray_version"], f"{name}: rayVersion vs {built[image]['path']}"
    assert cluster["rayVersion"] == ray.__version__, "the image's Ray differs from the one the tests ran against"


# -- monitoring ----------------------------------------------------------------------------------------
def pod_monitor() -> dict:
    (doc,) = [d for _, d in DOCS if d["kind"] == "PodMonitor"]
    return doc


def scrape_config() -> dict:
    (cm,) = [d for _, d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvserve-prometheus-scrape"]
    (text,) = cm["data"].values()
    return yaml.safe_load(text)


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_every_pod_exports_metrics_where_prometheus_looks(item):
    monitor = pod_monitor()["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    for name, group in pod_groups(item[1]):
        meta, port = group["template"]["metadata"], group["rayStartParams"].get("metrics-export-port")
        ports = {p["name"]: p["containerPort"] for p in ray_container(group).get("ports", [])}
        assert port and ports.get(endpoint["port"]) == int(port), f"{name}: metrics port"
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert meta["annotations"]["prometheus.io/port"] == port, f"{name}: prometheus.io/port"
        for key, value in monitor["selector"]["matchLabels"].items():
            assert meta["labels"].get(key) == value, f"{name}: PodMonitor selector misses this pod"


def test_prometheus_scrape_config():
    jobs = scrape_config()["scrape_configs"]
    assert [j["job_name"] for j in jobs] == ["kvserve-ray"]
    (job,) = jobs
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    # Prometheus anchors relabel regexes and writes $1 for groups; replay the address rewrite.
    (rule,) = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    joined = "10.1.2.3:6379;8080"  # __address__ and the prometheus.io/port annotation, joined with ';'
    m = re.fullmatch(rule["regex"], joined)
    assert m and re.sub(r"\$(\d+)", lambda g: m.group(int(g.group(1))), rule["replacement"]) == "10.1.2.3:8080"
    for r in job["relabel_configs"]:
        re.compile(r.get("regex", "(.*)"))


@functools.cache
def ray_metric_source() -> str:
    """Where Ray defines or charts its metrics: Serve's internals, the node reporter, Ray's dashboards."""
    import ray

    root = Path(ray.__file__).parent
    dirs = [root / "serve" / "_private", root / "dashboard" / "modules" / "reporter",
            root / "dashboard" / "modules" / "metrics" / "dashboards"]
    return "\n".join(p.read_text() for d in dirs for p in sorted(d.glob("*.py")))


def ray_exports(metric: str) -> bool:
    """`ray_serve_x_total` is exported if Ray registers "serve_x" or its own dashboards chart it."""
    base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
    return f'"{base.removeprefix("ray_")}"' in ray_metric_source() or base in ray_metric_source()


@functools.cache
def kvserve_exports() -> frozenset[str]:
    """The series names our engine metrics (workers.metrics.METRICS) get in Ray's Prometheus export."""
    from workers.metrics import METRICS

    return frozenset(name for spec in METRICS for name in spec.exported_names)


def exported(metric: str) -> bool:
    return metric in kvserve_exports() or ray_exports(metric)


def test_grafana_dashboard():
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    panels = dash["panels"]
    assert dash["title"] and dash["uid"] and len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    app_names = {a["name"] for _, d in RAY_SERVICES for a in serve_config(d)["applications"]}
    assert variables["application"]["query"] in app_names
    deployments = set(re.findall(r'serve\.deployment\(name="(\w+)"\)',
                                 "".join(p.read_text() for p in (ROOT / "router").glob("*.py"))))
    exprs = [t["expr"] for p in panels if p["type"] != "text" for t in p["targets"]]
    assert len(exprs) >= 8
    for expr in exprs:
        metrics = re.findall(r"\b(ray_\w+)\s*(?=[{\[)])", expr)
        assert metrics, expr
        unknown = [m for m in metrics if not exported(m)]
        assert not unknown, f"Ray exports no metric {unknown} ({expr})"
        assert set(re.findall(r'deployment="(\w+)"', expr)) <= deployments, expr
        assert set(re.findall(r"\$(\w+)", expr)) <= set(variables) | {"__rate_interval"}, expr
    from router import metrics as m

    charted = {name for expr in exprs for name in re.findall(r"\bray_(kvserve_\w+?)(?:_total|_bucket)?\b", expr)}
    wanted = {m.KV_USAGE, m.RUNNING, m.WAITING, m.TTFT, m.ITL, m.PREEMPTIONS, m.PREFIX_HITS, m.PREFIX_QUERIES}
    assert wanted <= charted, f"the dashboard charts none of {sorted(wanted - charted)}"


def test_metric_name_check_catches_mistakes():
    assert ray_exports("ray_serve_num_http_requests_total")
    assert not ray_exports("ray_serve_kv_block_usage")
    assert exported("ray_kvserve_kv_cache_usage_perc") and exported("ray_kvserve_num_preemptions_total")
    assert exported("ray_kvserve_time_to_first_token_seconds_bucket")
    assert not exported("ray_kvserve_num_preemptions")  # a counter is exported with _total only
    assert not exported("ray_kvserve_kv_usage")  # cluster.autoscale's name: goes to Serve's autoscaler only
