"""kvserve's version, as installed (`kvserve --version`, GET /version, the OpenAPI document)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvserve_version() -> str:
    try:
        return version("kvserve")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "0+unknown"
