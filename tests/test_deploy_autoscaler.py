"""Ray's own KubeRay autoscaler logic, fed each deploy/k8s profile and the placement groups that
cluster.app.build_app asks for: `ray.autoscaler._private.kuberay.autoscaling_config` turns the
RayService's rayClusterConfig into node types (as the autoscaler sidecar in the head pod does),
and its ResourceDemandScheduler says which pods it would launch for N pending engine replicas.

N replicas must launch N worker pods (one replica per GPU pod), up to the group's maxReplicas,
which leaves room for the replica an upgrade surges in; a profile whose pod cannot hold a
STRICT_PACK replica must show as infeasible instead of launching pods that split a
tensor-parallel group (what the PACK strategy did).
"""
from __future__ import annotations

import copy

import pytest

from tests.test_deploy_manifests import PROFILE_SERVICE, app_args, ray_container

HEAD_IP = "10.0.0.1"  # a name in the scheduler's bookkeeping; nothing is contacted


def autoscaling_config(doc: dict) -> dict:
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    ray_cr = {"metadata": {"name": doc["metadata"]["name"], "namespace": "default"},
              "spec": copy.deepcopy(doc["spec"]["rayClusterConfig"])}
    return _derive_autoscaling_config_from_ray_cr(ray_cr)


class HeadOnly:
    """The NodeProvider view the scheduler needs: a cluster of just the (running) head pod."""

    def node_tags(self, node_id):
        from ray.autoscaler.tags import (NODE_KIND_HEAD, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND,
                                         TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE)

        return {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: "headgroup",
                TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}

    def internal_ip(self, node_id):
        return HEAD_IP


def placement_group(bundles: list[dict], strategy: str):
    from ray.core.generated.common_pb2 import Bundle, PlacementStrategy
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    return PlacementGroupTableData(strategy=PlacementStrategy.Value(strategy),
                                   bundles=[Bundle(unit_resources=b) for b in bundles])


def pods_to_launch(config: dict, pending: list) -> tuple[dict, list]:
    """-> ({worker group: pods to add}, demands left unfulfilled) for these pending placement groups."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import ResourceDemandScheduler

    types = config["available_node_types"]
    scheduler = ResourceDemandScheduler(HeadOnly(), types, config["max_workers"], config["head_node_type"],
                                        config["upscaling_speed"])
    head = dict(types["headgroup"]["resources"])
    return scheduler.get_nodes_to_launch(["head"], {}, [], {HEAD_IP: head}, pending, {HEAD_IP: head}, [],
                                         NodeAvailabilitySummary(node_availabilities={}))


def replica_groups(doc: dict, n: int, strategy: str | None = None) -> list:
    """The placement groups of n engine replicas, as build_app's deployment options request them."""
    import cluster.app

    engine, options = cluster.app.split_args(app_args(doc))
    opts = cluster.app.engine_deployment_options(engine, options)
    if "placement_group_bundles" in opts:
        bundles, strat = opts["placement_group_bundles"], strategy or opts["placement_group_strategy"]
    else:  # tp = 1: the replica actor alone (a one-bundle group asks for the same)
        a = opts["ray_actor_options"]
        bundles, strat = [{"CPU": float(a["num_cpus"]), **({"GPU": float(a["num_gpus"])} if a.get("num_gpus") else {})}], "PACK"
    return [placement_group(bundles, strat) for _ in range(n)]


@pytest.mark.parametrize("profile", sorted(PROFILE_SERVICE))
def test_node_types_are_the_pods_limits(profile):
    doc = PROFILE_SERVICE[profile]
    config = autoscaling_config(doc)
    head = config["available_node_types"]["headgroup"]
    assert head["resources"]["CPU"] == 0 and head["max_workers"] == 0  # rayStartParams num-cpus "0"
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        t = config["available_node_types"][group["groupName"]]
        limits = ray_container(group)["resources"]["limits"]
        assert t["resources"]["CPU"] == int(limits["cpu"])
        assert t["resources"].get("GPU", 0) == int(limits.get("nvidia.com/gpu", 0))
        assert (t["min_workers"], t["max_workers"]) == (group["minReplicas"], group["maxReplicas"])


@pytest.mark.parametrize("profile", ["gpu-8b-tp2", "gpu-70b-tp8"])
def test_n_replicas_launch_n_gpu_pods_up_to_max_replicas_plus_the_surge(profile):
    import cluster.app

    doc = PROFILE_SERVICE[profile]
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    config = autoscaling_config(doc)
    _, options = cluster.app.split_args(app_args(doc))
    most = options.max_engine_replicas + options.surge_replicas
    assert group["maxReplicas"] == most
    for n in range(1, most + 1):
        launch, unfulfilled = pods_to_launch(config, replica_groups(doc, n))
        assert launch == {group["groupName"]: n} and not unfulfilled, (n, launch, unfulfilled)
    launch, unfulfilled = pods_to_launch(config, replica_groups(doc, most + 1))
    assert launch == {group["groupName"]: most} and len(unfulfilled) == 1  # one more waits: maxReplicas


def test_cpu_profile_holds_its_replica_and_the_surging_one_on_its_one_pod():
    doc = PROFILE_SERVICE["cpu"]
    config = autoscaling_config(doc)
    for n in (1, 2):  # the replica, and the one a config change starts beside it
        launch, unfulfilled = pods_to_launch(config, replica_groups(doc, n))
        assert launch == {"cpu": 1} and not unfulfilled


def test_a_tp8_replica_on_8_cpu_pods_is_infeasible_not_split():
    doc = copy.deepcopy(PROFILE_SERVICE["gpu-70b-tp8"])
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for key in ("requests", "limits"):
        ray_container(group)["resources"][key]["cpu"] = "8"
    config = autoscaling_config(doc)
    launch, unfulfilled = pods_to_launch(config, replica_groups(doc, 1))
    # The min_workers pod is launched anyway, but the replica's 9 CPUs + 8 GPUs stay unfulfilled.
    assert launch == {group["groupName"]: 1}
    assert unfulfilled == [{"CPU": 9.0, "GPU": 8.0}]


def test_pack_would_split_a_tensor_parallel_group_across_pods_strict_pack_does_not():
    """On pods of 1 GPU, PACK lets the autoscaler launch two pods for one tp=2 replica (its ranks would
    then rendezvous on 127.0.0.1 across two pods and hang); STRICT_PACK asks for one pod that holds
    it all, which 1-GPU pods cannot: an infeasible demand that Ray reports, not a hang."""
    doc = copy.deepcopy(PROFILE_SERVICE["gpu-8b-tp2"])
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    group["minReplicas"] = group["replicas"] = 0
    for key in ("requests", "limits"):
        ray_container(group)["resources"][key]["nvidia.com/gpu"] = 1
    config = autoscaling_config(doc)
    launch, unfulfilled = pods_to_launch(config, replica_groups(doc, 1, strategy="PACK"))
    assert launch == {group["groupName"]: 2} and not unfulfilled
    launch, unfulfilled = pods_to_launch(config, replica_groups(doc, 1))
    assert launch == {} and unfulfilled == [{"CPU": 3.0, "GPU": 2.0}]
