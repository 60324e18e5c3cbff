"""vLLM's `--generation-config`: the sampling fields of a model's generation_config.json as the
defaults of requests that leave them unset.

    auto    the model folder's generation_config.json (vLLM's default)
    vllm    none: OpenAI's defaults (temperature 1, top_p 1, no top_k / min_p / penalty)
    DIR     DIR's generation_config.json

`--override-generation-config` (a JSON object of the same fields) goes on top. Only these fields
count, as in vLLM; `max_new_tokens` bounds a request that sets no max_tokens. The server applies
them to each request's unset fields (router.settings); the offline `LLM` to a call given no
SamplingParams (`LLM.get_default_sampling_params`), as vLLM's does.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: str, model_dir: Path, overrides: dict | None = None,
                      check: Callable[[dict], None] | None = None) -> dict[str, float | int]:
    """-> request field -> default, from `source` (auto | vllm | a folder) and `overrides`;
    ValueError for a value `check` refuses (default: one SamplingParams refuses)."""
    if source == "vllm":
        found = {}
    else:
        folder = model_dir if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config {source!r}: not auto, vllm or a directory")
        found = _read(folder / "generation_config.json")
    unknown = sorted(set(overrides or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(FIELDS)})")
    found.update(overrides or {})
    defaults = {FIELDS[k]: _number(k, v) for k, v in found.items() if k in FIELDS and v is not None}
    (check or _check)({k: v for k, v in defaults.items() if k != "max_tokens"})
    if defaults.get("max_tokens", 1) < 1:
        raise ValueError(f"generation config max_new_tokens must be >= 1, got {defaults['max_tokens']}")
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    return defaults


def _check(values: dict) -> None:
    try:
        SamplingParams(**values)
    except ValueError as e:
        raise ValueError(f"generation config: {e}") from None


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def _number(name: str, value) -> float | int:
    integer = name in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not math.isfinite(value):
        raise ValueError(f"generation config {name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value
