"""One `kvserve serve` for every module of this package (package scope: started by the first
test that needs it, stopped after the last one, so no other server of the suite runs beside it)."""
from __future__ import annotations

import pytest

from tests.reliability.harness import ServeProcess
from tests.reliability.small_pool.common import KEY, SERVE_ARGS


@pytest.fixture(scope="package")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-small-pool") / "serve.log"
    with ServeProcess(["--model", str(tiny_model), *SERVE_ARGS], log, api_key=KEY) as srv:
        yield srv
