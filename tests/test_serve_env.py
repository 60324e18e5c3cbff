"""The Serve settings `kvserve serve` starts Ray with, and the benchmarks' /proc accounting."""
from __future__ import annotations

import os

from benchmarks.proc_cpu import cpu_seconds, cpu_used, process_name
from cluster.serve_cli import app_args_from_cli
from cluster.cli import build_parser
from cluster.serve_env import SERVE_ENV, apply_serve_env


def test_serve_env_fills_in_what_is_unset_and_keeps_what_is_set():
    env = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}
    assert apply_serve_env(env) == {**SERVE_ENV, "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}
    env = {}
    assert apply_serve_env(env) == SERVE_ENV and env == SERVE_ENV


def test_engine_cls_flag_reaches_the_app_args():
    ns = build_parser().parse_args(["serve", "--engine-cls", "benchmarks.paced_engine:PacedEngine"])
    assert app_args_from_cli(ns)["engine_cls"] == "benchmarks.paced_engine:PacedEngine"


def test_process_names_and_cpu_of_this_process_tree():
    assert process_name("ray::ServeReplica:kvserve:EngineServer.handle_request") == "EngineServer"
    assert process_name("ray::ProxyActor") == "ProxyActor"
    assert process_name("/venv/bin/python -m cluster.cli serve --port 1") == "cluster.cli"
    assert process_name("/venv/bin/python /x/ray/dashboard/dashboard.py --host=1") == "dashboard"
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    after = cpu_seconds(os.getpid())
    assert os.getpid() in after
    assert all(v >= 0 for v in cpu_used(before, after).values())
