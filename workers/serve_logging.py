"""Our loggers inside a Ray Serve replica. There only Serve's own logger (`ray.serve`) has
handlers, which write the replica's log file (what the Ray dashboard shows) and its stderr (which
Ray forwards to the driver: `kvserve serve`'s console, a pod's `kubectl logs`); the lines of any
other logger are lost below WARNING."""
from __future__ import annotations

import logging


def log_through_serve(*names: str) -> None:
    """Send the INFO lines of each logger in `names` (and of its children) through Serve's handlers."""
    serve_logger = logging.getLogger("ray.serve")
    for name in names:
        ours = logging.getLogger(name)
        ours.setLevel(logging.INFO)
        for handler in serve_logger.handlers:
            if handler not in ours.handlers:
                ours.addHandler(handler)
        ours.propagate = False


# vLLM's --uvicorn-log-level values; here the level of Serve's own lines in a replica (trace: debug)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve_logging_config(access_log: bool = True, level: str | None = None) -> dict | None:
    """A deployment's Serve logging_config: None for Serve's defaults; `access_log` False: no line
    per request; `level`: one of UVICORN_LOG_LEVELS for Serve's own lines (ours keep INFO, above)."""
    config = {}
    if not access_log:
        config["enable_access_log"] = False
    if level is not None:
        config["log_level"] = "DEBUG" if level == "trace" else level.upper()
    return config or None

