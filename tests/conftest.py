import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """Converted embedded SmolLM2-135M-Instruct (float safetensors + tokenizer), created once."""
    from engine.model_source import resolve_model

    return str(resolve_model(None))
