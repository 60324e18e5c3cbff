"""Ray Serve settings kvserve runs with, read from the environment by every Serve process.

Measured with benchmarks/serving_overhead.py (16 streams, a paced model-free engine, 2 cores):

    RAY_SERVE_USE_GRPC_BY_DEFAULT=1   the proxy -> ingress and ingress -> engine replica calls go
                                      over Serve's gRPC transport instead of Ray actor tasks: the
                                      CPU per streamed token of the ingress, the proxy and the
                                      replica's transport falls from ~2.4 ms to ~1.2 ms

    RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647
                                      that transport's largest message, 4 MiB by default, as large
                                      as the proxy's (2 GiB): a reply is one message, and a request
                                      of 8 MiB (--max-request-body-bytes) may well reply more (echo
                                      and 20 logprobs a token over long prompts: a bare 500)

They must be in the environment before Ray starts (a local Ray's processes inherit the driver's
environment); a value already set there wins. On a running cluster they belong in every pod's
environment (every Ray container of deploy/k8s sets them).
"""
from __future__ import annotations

import os

SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def apply_serve_env(environ=os.environ) -> dict[str, str]:
    """Sets what is not set yet; returns the settings in effect."""
    for key, value in SERVE_ENV.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in SERVE_ENV}
