import os
import signal

import pytest


def _triton_interpreter_wanted() -> bool:
    import torch

    return not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ


# The Triton kernel tests run under Triton's interpreter on a host without CUDA. Triton reads
# TRITON_INTERPRET when it is imported (collection does that: transformers imports it), so the
# variable is set from here until collection ends, then again only while those tests run
# (tests/triton_interp.py); other tests and the processes they start never see it.
TRITON_INTERPRETER = _triton_interpreter_wanted()
if TRITON_INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # now, whichever test would import it first
        import triton.language  # noqa: F401
    except ImportError:
        pass


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # SIGTERM (`timeout`, a CI runner's cancel) ends the run as Ctrl-C does: the running test's
    # `finally:` blocks and the fixtures' teardowns stop the servers and Ray clusters they started
    # in sessions of their own, which a plain SIGTERM of pytest would leave running.
    signal.signal(signal.SIGTERM, _terminated)
    # Named here rather than in pyproject's filterwarnings: pytest imports a filter's category when
    # it reads its configuration, and the GPU host benchmarks/gpu_check.sh runs on has no pydantic.
    try:
        import pydantic.warnings  # noqa: F401
    except ImportError:
        return
    config.addinivalue_line("filterwarnings", "ignore::pydantic.warnings.PydanticDeprecatedSince20")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # Again once the test's fixtures are up: ray.init takes SIGTERM over in the driver (sys.exit,
    # which fails one test and goes on; after ray.shutdown, nothing: pytest dies unclean).
    signal.signal(signal.SIGTERM, _terminated)


def pytest_collection_finish(session):
    if TRITON_INTERPRETER:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(scope="session")
def smollm2_path():
    """Converted embedded SmolLM2-135M-Instruct (float safetensors + tokenizer), created once."""
    from engine.model_source import resolve_model

    return str(resolve_model(None))


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """The embedded SmolLM2's HF tokenizer, loaded once (a test that changes one changes a copy)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def bos_tokenizer(tokenizer):
    """SmolLM2's tokenizer made to begin every encoding with a BOS (<|endoftext|>, id 0), as
    Llama's does; SmolLM2's own adds nothing, so the default model never shows the difference."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return tok
