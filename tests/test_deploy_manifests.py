"""deploy/k8s: manifests that KubeRay accepts and that deploy our real application.

No cluster and no running Ray: each profile's RayService (deploy/k8s/<profile>/rayservice.yaml)
is validated against the openAPIV3Schema of KubeRay's CRDs (../shared/kuberay-crds), closed to
unknown fields as `kubectl apply`'s strict field validation is; serveConfigV2 against Serve's
own config schema, then its import_path is imported and its args go through cluster.app.build_app
(with only the model-directory check stubbed out, since the models live on the cluster's volume);
each profile's pods against cluster.sizing (CPUs, GPUs, memory, load time); each profile as
`kubectl kustomize` renders it (what `kubectl apply -k` sends: images, Secrets, the weights
volume and Job); the monitoring files against the metric and deployment names that really exist
(Ray's own, and ours from workers.metrics).
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CRDS = ROOT.parent / "shared" / "kuberay-crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
GPU = "nvidia.com/gpu"
PROFILES = ("cpu", "gpu-8b-tp2", "gpu-70b-tp8")
GPU_MEMORY_ANNOTATION = "kvserve.dev/gpu-memory"


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if d is not None]


MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(str(p.relative_to(K8S)), d) for p in MANIFESTS for d in load_all(p)]
RAY_DOCS = [(f, d) for f, d in DOCS if d.get("apiVersion") == "ray.io/v1"]
RAY_SERVICES = [(f, d) for f, d in DOCS if d.get("kind") == "RayService"]
PROFILE_SERVICE = {f.split("/")[0]: d for f, d in RAY_SERVICES}


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
        ingress = cluster.app.ingress_deployment_options(options)
        # a stopping ingress outlives its engine replicas' drain: their streams end cleanly through it
        assert ingress["graceful_shutdown_timeout_s"] > opts["graceful_shutdown_timeout_s"]
        if "request_router_config" in ingress:  # the proxies import it: it must resolve
            assert resolve(ingress["request_router_config"].request_router_class)
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


def component_images() -> dict[str, str]:
    """Placeholder image name -> the registry-qualified image that components/image sets."""
    (doc,) = load_all(K8S / "components" / "image" / "kustomization.yaml")
    return {i["name"]: f"{i['newName']}:{i['newTag']}" for i in doc["images"]}


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_images_come_from_our_dockerfiles_with_the_same_ray(item):
    import ray

    doc, built = item[1], dockerfiles()
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    for name, group in pod_groups(doc):
        image = component_images().get(ray_container(group)["image"], ray_container(group)["image"])
        assert image in built, f"{name}: image {image} is built by none of {sorted(built)}"
        assert cluster["rayVersion"] == built[image]["ray_version"], f"{name}: rayVersion vs {built[image]['path']}"
    assert cluster["rayVersion"] == ray.__version__, "the image's Ray differs from the one the tests ran against"


# -- monitoring ----------------------------------------------------------------------------------------
def pod_monitor() -> dict:
    (doc,) = [d for _, d in DOCS if d["kind"] == "PodMonitor"]
    return doc


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_every_ray_container_runs_with_the_serve_settings_kvserve_serve_uses(item):
    from cluster.serve_env import SERVE_ENV

    for name, group in pod_groups(item[1]):
        env = {e["name"]: e.get("value") for e in ray_container(group).get("env", [])}
        for key, value in SERVE_ENV.items():
            assert env.get(key) == value, f"{name}: {key} must be {value!r} before Ray starts"


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
    from engine.metrics import METRICS

    return frozenset(name for spec in METRICS for name in spec.exported_names)


def exported(metric: str) -> bool:
    return metric in kvserve_exports() or ray_exports(metric)


def test_grafana_dashboard():
    dash = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    panels = dash["panels"]
    assert dash["title"] and dash["uid"] and len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    app_names = {a["name"] for _, d in RAY_SERVICES for a in serve_config(d)["applications"]}
    assert variables["application"]["query"] in app_names
    deployments = set(re.findall(r'serve\.deployment\(name="(\w+)"\)',
                                 "".join(p.read_text() for d in ("router", "workers") for p in (ROOT / d).glob("*.py"))))
    exprs = [t["expr"] for p in panels if p["type"] != "text" for t in p["targets"]]
    assert len(exprs) >= 8
    for expr in exprs:
        metrics = re.findall(r"\b(ray_\w+)\s*(?=[{\[)])", expr)
        assert metrics, expr
        unknown = [m for m in metrics if not exported(m)]
        assert not unknown, f"Ray exports no metric {unknown} ({expr})"
        assert set(re.findall(r'deployment="(\w+)"', expr)) <= deployments, expr
        assert set(re.findall(r"\$(\w+)", expr)) <= set(variables) | {"__rate_interval"}, expr
    from engine import metrics as m

    charted = {name for expr in exprs for name in re.findall(r"\bray_(kvserve_\w+?)(?:_total|_bucket)?\b", expr)}
    wanted = {m.KV_USAGE, m.RUNNING, m.WAITING, m.TTFT, m.ITL, m.PREEMPTIONS, m.PREFIX_HITS, m.PREFIX_QUERIES,
              m.ENGINE_STEPS, m.ENGINE_STEP_SECONDS, m.SPEC_DRAFTS, m.SPEC_DRAFT_TOKENS, m.SPEC_ACCEPTED}
    assert wanted <= charted, f"the dashboard charts none of {sorted(wanted - charted)}"


def test_metric_name_check_catches_mistakes():
    assert ray_exports("ray_serve_num_http_requests_total")
    assert not ray_exports("ray_serve_kv_block_usage")
    assert exported("ray_kvserve_kv_cache_usage_perc") and exported("ray_kvserve_num_preemptions_total")
    assert exported("ray_kvserve_time_to_first_token_seconds_bucket")
    assert not exported("ray_kvserve_num_preemptions")  # a counter is exported with _total only
    assert not exported("ray_kvserve_kv_usage")  # cluster.autoscale's name: goes to Serve's autoscaler only


# -- what `kubectl apply -k deploy/k8s/<profile>` sends -------------------------------------------------
@functools.cache
def rendered(profile: str, tmp_root: str) -> tuple[dict, ...]:
    """The profile as `kubectl kustomize` renders it, the secrets' .env files made from their templates
    (in a copy of deploy/k8s: the real ones are git-ignored and absent from a clean checkout)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    tree = Path(tmp_root) / "k8s"
    if not tree.exists():
        shutil.copytree(K8S, tree)
        for example in tree.glob("secrets/*/*.env.example"):
            shutil.copy(example, example.with_suffix(""))
    out = subprocess.run([kubectl, "kustomize", str(tree / profile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(scope="module")
def render_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kustomize"))


def pod_specs(doc: dict):
    """(where, pod spec) of every pod template in a rendered document."""
    if doc["kind"] == "RayService":
        for name, group in pod_groups(doc):
            yield f"RayService {name}", group["template"]["spec"]
    elif doc["kind"] == "Job":
        yield f"Job {doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def app_args(doc: dict) -> dict:
    (app,) = serve_config(doc)["applications"]
    return app.get("args") or {}


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_renders_with_one_image_name_and_every_object_it_needs(profile, render_root):
    docs = rendered(profile, render_root)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    images = {c["image"] for d in docs for _, spec in pod_specs(d)
              for c in spec["containers"] + spec.get("initContainers", [])}
    assert images <= set(component_images().values()), f"images not set by components/image: {images}"
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for image in images:
        name, _, tag = image.rpartition(":")
        assert "." in name.split("/")[0] and name.count("/") >= 2, f"{image}: not registry-qualified"
        assert tag.startswith(f"{version}-ray{service['spec']['rayClusterConfig']['rayVersion']}-"), image
    for where, spec in (w for d in docs for w in pod_specs(d)):
        for c in spec["containers"] + spec.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ("Secret", ref["name"]) in kinds, f"{where}: Secret {ref['name']} is not in the profile"
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in kinds, where
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in kinds, where
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "kvserve-api-key"]
    assert set(secret["data"]) == {"key"}


@pytest.mark.parametrize("profile", [p for p in PROFILES if p.startswith("gpu")])
def test_gpu_profile_fills_its_volume_before_any_ray_pod_reads_it(profile, render_root):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("fill_weights", K8S / "weights" / "fill_weights.py")
    fill = module_from_spec(spec)
    spec.loader.exec_module(fill)
    docs = rendered(profile, render_root)
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    model = app_args(service)["model"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2].startswith("hf://") and container["command"][-1] == model
    assert {"name": "MODEL_DIR", "value": model} in container["env"]
    assert set(pvc["spec"]["accessModes"]) <= {"ReadWriteMany", "ReadWriteOnce"}
    for where, pod in pod_specs(service):
        (claim,) = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}, where
        waits = [c for c in pod.get("initContainers", []) if f"{model}/{fill.MARKER}" in " ".join(c["command"])]
        assert waits, f"{where}: no init container waits for {model}/{fill.MARKER}"


def test_weights_fill_downloads_once_and_marks_the_directory(tmp_path, smollm2_path):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("fill_weights", K8S / "weights" / "fill_weights.py")
    fill = module_from_spec(spec)
    spec.loader.exec_module(fill)
    calls = []

    def download(repo: str, dest: Path) -> None:  # stands in for the hub: copies a real checkpoint
        calls.append(repo)
        for f in Path(smollm2_path).iterdir():
            if f.suffix in (".json", ".safetensors"):
                shutil.copy(f, dest / f.name)

    dest = tmp_path / "models" / "SmolLM2"
    assert fill.fill("hf://org/SmolLM2", dest, download) is True
    assert (dest / fill.MARKER).is_file() and (dest / "config.json").is_file()
    assert not dest.with_name("SmolLM2.partial").exists()
    assert fill.fill("hf://org/SmolLM2", dest, download) is False and calls == ["org/SmolLM2"]
    with pytest.raises(SystemExit):
        fill.fill("s3://bucket/x", tmp_path / "other", download)
    with pytest.raises(SystemExit, match="no config.json"):
        fill.fill("hf://org/empty", tmp_path / "empty", lambda repo, dest: None)


@pytest.mark.parametrize("item", RAY_SERVICES, ids=doc_id)
def test_cluster_is_secured_upgrades_without_outage_and_serves_only_when_ready(item):
    import cluster.app

    doc = item[1]
    spec = doc["spec"]
    assert spec["rayClusterConfig"]["authOptions"]["mode"] == "token", "Ray's dashboard and API open to anyone"
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade")
    assert spec.get("excludeHeadPodFromServeSvc"), "traffic must enter where readiness follows /ready"
    port = serve_config(doc)["http_options"]["port"]
    for name, group in pod_groups(doc):
        probe = ray_container(group).get("readinessProbe")
        if name == "head":
            assert probe is None, "the head keeps KubeRay's probe: KubeRay waits for a Ready head to deploy"
            continue
        assert probe["exec"]["command"][:5] == ["python", "-m", "cluster.probe", "--serve-port", str(port)], name
    engine, options = cluster.app.split_args(app_args(doc))
    opts = cluster.app.engine_deployment_options(engine, options)
    assert opts["max_surge_percent"] > 0, "a config change would stop the old replicas before new ones run"
    if engine.tensor_parallel_size > 1:
        assert opts["placement_group_strategy"] == "STRICT_PACK"
        assert len(opts["placement_group_bundles"]) == 1 + engine.tensor_parallel_size


# -- sizing: the pods hold the replicas, the replicas load in time ------------------------------------
_QUANTITY = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(v) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(v))
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def node_shapes(doc: dict):
    """cluster.sizing's view of each worker group's pod: its limits, as KubeRay hands them to Ray."""
    from cluster.sizing import NodeShape

    for name, group in pod_groups(doc):
        if name == "head":
            continue
        limits = ray_container(group)["resources"]["limits"]
        gpu_memory = group["template"]["metadata"].get("annotations", {}).get(GPU_MEMORY_ANNOTATION)
        yield group, NodeShape(name, quantity(limits["cpu"]), quantity(limits.get(GPU, 0)),
                               int(quantity(limits["memory"])), int(quantity(gpu_memory)) if gpu_memory else None)


def llama(hidden: int, inter: int, layers: int, heads: int, kv: int):
    from engine.model.llama import ModelArch

    return ModelArch(vocab_size=128256, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, rms_norm_eps=1e-5,
                     rope_theta=500000.0, rope_scaling=None, max_position_embeddings=131072,
                     tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


# The profiles' checkpoints live on the cluster's volume; their shapes are their published configs.
ARCHS = {"/models/Llama-3.1-8B-Instruct": lambda: llama(4096, 14336, 32, 32, 8),
         "/models/Llama-3.1-70B-Instruct": lambda: llama(8192, 28672, 80, 64, 8)}


def profile_model(doc: dict, smollm2_path: str):
    """-> engine config, serve options, model arch, model dir (None: a checkpoint on the cluster's volume)."""
    import cluster.app
    from engine.model.loader import load_arch

    engine, options = cluster.app.split_args(app_args(doc))
    model_dir = smollm2_path if engine.model is None else None
    return engine, options, load_arch(model_dir)[0] if model_dir else ARCHS[engine.model](), model_dir


def profile_needs(doc: dict, smollm2_path: str):
    import cluster.app
    from cluster import sizing

    engine, options, arch, model_dir = profile_model(doc, smollm2_path)
    ckpt = sizing.checkpoint_bytes(model_dir, arch)
    return engine, options, sizing.replica_needs(engine, arch, ckpt, cluster.app.use_gpu(engine))


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_pods_hold_max_replicas_plus_an_upgrade_surge_and_load_in_time(profile, smollm2_path):
    import cluster.app
    from cluster import sizing

    doc = PROFILE_SERVICE[profile]
    engine, options, arch, model_dir = profile_model(doc, smollm2_path)
    shapes = list(node_shapes(doc))
    needs = cluster.app.check_sizing(engine, options, arch, model_dir, nodes=[s for _, s in shapes])  # what build_app runs
    capacity = sum(group["maxReplicas"] * sizing.replicas_per_node(needs, shape) for group, shape in shapes)
    assert capacity >= options.max_engine_replicas + options.surge_replicas, \
        f"{capacity} replicas fit the worker groups; the app may run {options.max_engine_replicas} + " \
        f"{options.surge_replicas} surging during an upgrade"
    if engine.tensor_parallel_size > 1:
        assert needs.load_s(options.weights_read_bytes_per_s) <= options.load_timeout_s


@pytest.mark.parametrize("mutate, expect", [
    (lambda limits: limits.__setitem__("cpu", "8"), "needs 9 CPUs"),  # TP8 on an 8-CPU pod
    (lambda limits: limits.__setitem__(GPU, 4), "multi-node tensor parallelism is not supported"),
    (lambda limits: limits.__setitem__("memory", "16Gi"), "of memory"),
])
def test_sizing_refuses_a_70b_tp8_pod_that_cannot_hold_a_replica(mutate, expect, smollm2_path):
    from cluster import sizing

    doc = copy.deepcopy(PROFILE_SERVICE["gpu-70b-tp8"])
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    mutate(ray_container(group)["resources"]["limits"])
    engine, options, needs = profile_needs(doc, smollm2_path)
    with pytest.raises(sizing.SizingError, match=expect):
        sizing.check(needs, [s for _, s in node_shapes(doc)], options.load_timeout_s, options.weights_read_bytes_per_s)


def test_a_cpu_replica_counts_every_form_of_its_weights(tmp_path, smollm2_path):
    """Float32 on CPU holds the weights, their oneDNN-prepacked copy and, for a bfloat16
    checkpoint, their bfloat16 halves for decode; a pooling replica holds no language-model head
    (its table is a lookup table only; a classifier has its small head); what the sizing check
    counts, measured on load."""
    import torch

    from cluster import sizing
    from engine import cpu_kernels
    from engine.model.loader import build_model, held_weight_bytes, load_arch
    from tests.tiny_llama import make_tiny_classifier, make_tiny_llama

    if not cpu_kernels.enabled():
        pytest.skip("no native CPU kernels here: the weights are held once")
    for kind in ("gqa-bf16", "qwen3-bf16", "gqa", "gqa-fp16", "classifier-bf16"):  # untied and tied heads; float32
        # and float16 on disk (no bfloat16 halves)
        classifier = kind == "classifier-bf16"
        d = make_tiny_classifier(tmp_path / "gqa-bf16", tmp_path / kind, 2) if classifier else make_tiny_llama(
            tmp_path / kind, smollm2_path, kind)
        arch = load_arch(d)[0]
        for pooling in (True,) if classifier else (False, True):
            model = build_model(d, torch.float32, torch.device("cpu"), pooling=pooling)  # prepacked copies and codes
            assert any(getattr(m, "weight_codes", None) is not None for m in model.modules()) == kind.endswith("bf16")
            held = held_weight_bytes(model)
            counted = sizing.cpu_weight_bytes(arch, 4, sizing.checkpoint_bytes(d, arch), pooling,
                                              sizing.checkpoint_dtype(d))
            assert 0.95 * held <= counted <= 1.05 * held, (kind, pooling, held, counted)
            assert sizing.cpu_weight_bytes(arch, 2, sizing.checkpoint_bytes(d, arch), pooling) == sizing.param_count(
                arch, pooling) * 2
    from benchmarks.quantize import quantize_checkpoint

    # GPTQ and AWQ: the layers' weights as 4-bit codes (float32 where act-order leaves no 32-weight grid)
    for method, kw in (("gptq", {}), ("awq", {}), ("gptq", {"act_order": True})):
        d = tmp_path / f"{method}-{len(kw)}"
        quantize_checkpoint(tmp_path / "gqa", d, tmp_path / f"{method}-{len(kw)}-float", method, **kw)
        arch, model = load_arch(d)[0], build_model(d, torch.float32, torch.device("cpu"))
        held, counted = held_weight_bytes(model), sizing.cpu_weight_bytes(arch, 4, sizing.checkpoint_bytes(d, arch))
        assert 0.95 * held <= counted <= 1.05 * held, (method, kw, held, counted)
    from tests.tiny_bert import make_tiny_encoder

    for kind, labels, extra in (("bert", 0, {}), ("xlm-roberta", 2, {}), ("bert", 3, {"per_token": True}),
                                ("nomic_bert", 0, {}), ("nomic_bert", 1, {}), ("modernbert", 3, {"per_token": True}),
                                ("modernbert", 0, {}), ("gte", 0, {"type_vocab_size": 0}), ("gte", 2, {}),
                                ("distilbert", 0, {}), ("distilbert", 2, {}), ("distilbert", 3, {"per_token": True}),
                                ("modernbert", 2, {"norm_bias": True, "attention_bias": True, "mlp_bias": True,
                                                   "classifier_bias": True})):
        # an encoder holds its weights once, every one counted
        d = make_tiny_encoder(tmp_path / f"{kind}-{labels}", kind, num_labels=labels, **extra)
        model, arch = build_model(d, torch.float32, torch.device("cpu"), pooling=True), load_arch(d)[0]
        assert sizing.param_count(arch, True) == sum(p.numel() for p in model.parameters())
        assert sizing.cpu_weight_bytes(arch, 4, sizing.checkpoint_bytes(d, arch), True) == held_weight_bytes(model)


def test_sizing_refuses_a_load_timeout_the_volume_cannot_meet(smollm2_path):
    from cluster import sizing

    doc = PROFILE_SERVICE["gpu-70b-tp8"]
    engine, options, needs = profile_needs(doc, smollm2_path)
    assert 1000 < needs.load_s(sizing.DEFAULT_READ_BYTES_PER_S) < 1200  # 141 GB at 125 MiB/s
    with pytest.raises(sizing.SizingError, match="load_timeout_s=900"):
        sizing.check(needs, [], 900.0)
    with pytest.raises(sizing.SizingError, match="GPUs give the engine"):  # a 70B shard does not fit 16 GB GPUs
        sizing.check(needs, [sizing.NodeShape("small", 16, 8, 256 << 30, 16 << 30)], options.load_timeout_s)


def test_counters_are_exported_at_zero_from_the_start(monkeypatch):
    from ray.util import metrics as ray_util_metrics

    from engine import metrics as M
    from workers.metrics import ray_metrics

    recorded = []
    monkeypatch.setattr(ray_util_metrics.Metric, "_record",
                        lambda self, value, tags=None: recorded.append((self._name, value, dict(tags or {}))))
    ray_metrics("m")
    counters = {s.name for s in M.METRICS if s.kind == "Counter"}
    assert {name for name, v, _ in recorded if v == 0} == counters
    assert {t[M.FINISHED_REASON] for name, _, t in recorded if name == M.REQUEST_SUCCESS} == set(M.FINISHED_REASONS)
