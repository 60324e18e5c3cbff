"""vLLM's `--hf-overrides` (`LLM(hf_overrides=...)`): fields set over the model's config.json, as
if the folder said them. The engine reads a model from its folder in several processes (the
driver, tensor-parallel ranks, replicas on other nodes), so the overrides are not passed along:
each process resolves the same view of the folder, once per cache:

    $KVSERVE_CACHE/overrides/<digest>/<model folder's name>/
        config.json            the folder's, with the overrides merged in (a dict into a dict)
        score.safetensors      a converted classifier's head (below), where one is asked for
        kvserve_source.json    the folder and overrides it was made from, so a stale view is redone
        every other file       a link to the folder's own

A causal LM made a classifier (vLLM's `classifier_from_token`): the overrides name a
`...ForSequenceClassification` architecture and the tokens whose language-model head rows make
the classifier's head, e.g. Qwen3-Reranker's, as vLLM's docs give them:

    {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
     "is_original_qwen3_reranker": true}

    from_2_way_softmax   two tokens (false, true): one label, the head row true - false, so the
                         score's sigmoid is the softmax of "yes" over the two (Qwen3-Reranker's
                         own formula; `is_original_qwen3_reranker` asks for it)
    no_post_processing   one label per token, its row as it is (bge-reranker-v2-gemma)

Such a classifier reads a pair's two texts joined (`use_pad_token` false, vLLM's default for an
LLM made a reranker); its prompts are formatted by the caller, as with vLLM."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.vllm_args import json_dict

METHODS = ("from_2_way_softmax", "no_post_processing")
_CONVERSION_KEYS = ("method", "classifier_from_token", "is_original_qwen3_reranker")
_FORMAT = 1
_SOURCE_FILE = "kvserve_source.json"
_SCORE_FILE = "score.safetensors"


def parse_hf_overrides(value) -> dict:
    """--hf-overrides (a dict, or its JSON) -> the dict; ValueError naming what is not taken."""
    if value is None:
        return {}
    value = json_dict("hf_overrides", value)
    if any(not isinstance(k, str) or not k for k in value):
        raise ValueError(f"hf_overrides: its keys are config.json field names, got {sorted(map(str, value))}")
    conversion = _conversion(value)
    if conversion is not None:
        arch = value.get("architectures")
        if not (isinstance(arch, list) and len(arch) == 1 and str(arch[0]).endswith("ForSequenceClassification")):
            raise ValueError("hf_overrides: classifier_from_token makes a classifier; give its architecture too, as "
                             '"architectures": ["Qwen3ForSequenceClassification"]')
    return value


def _conversion(overrides: dict) -> tuple[str, list[str]] | None:
    """(method, tokens) where the overrides make a causal LM's head rows a classifier's."""
    tokens = overrides.get("classifier_from_token")
    method = overrides.get("method")
    if overrides.get("is_original_qwen3_reranker"):
        method = method or "from_2_way_softmax"
    if method is None and tokens is None:
        return None
    if method not in METHODS:
        raise ValueError(f"hf_overrides: method {method!r} is not supported (vLLM's: {', '.join(METHODS)}); "
                         "classifier_from_token needs one")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"hf_overrides: classifier_from_token must be a list of tokens, got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"hf_overrides: from_2_way_softmax takes two tokens (false, true), got {tokens!r}")
    return method, tokens


def overridden_dir(model_dir: Path, overrides: dict, tokenizer_dir: Path) -> Path:
    """The view of `model_dir` with `overrides` (parse_hf_overrides') applied, made once per
    cache; `model_dir` itself where there are none. `tokenizer_dir`: where a conversion's tokens
    are looked up."""
    if not overrides:
        return model_dir
    source = {"format": _FORMAT, "model": str(model_dir), "overrides": overrides,
              "files": {f.name: f.stat().st_size for f in sorted(model_dir.iterdir()) if f.is_file()},
              "config": (model_dir / "config.json").read_text()}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    from engine.model_source import cache_dir

    target = cache_dir() / "overrides" / digest / model_dir.name
    if _is_made(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _make_view(model_dir, overrides, tokenizer_dir, tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first: use theirs
            if not _is_made(target, source):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_made(target: Path, source: dict) -> bool:
    try:
        return json.loads((target / _SOURCE_FILE).read_text()) == source
    except (OSError, ValueError):
        return False


def _make_view(model_dir: Path, overrides: dict, tokenizer_dir: Path, out: Path) -> None:
    config = _merged(json.loads((model_dir / "config.json").read_text()), overrides)
    conversion = _conversion(overrides)
    if conversion is not None:
        method, tokens = conversion
        _write_score_head(model_dir, config, method, _token_ids(tokenizer_dir, tokens), out / _SCORE_FILE)
        for key in _CONVERSION_KEYS:
            config.pop(key, None)
        n = 1 if method == "from_2_way_softmax" else len(tokens)
        labels = {str(i): f"LABEL_{i}" if n == 1 else tokens[i] for i in range(n)}
        config.update(num_labels=n, id2label=labels, label2id={v: int(k) for k, v in labels.items()})
        config.setdefault("use_pad_token", False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in model_dir.iterdir():
        if f.name not in ("config.json", _SOURCE_FILE, _SCORE_FILE):
            os.symlink(f.resolve(), out / f.name)


def _merged(base: dict, overrides: dict) -> dict:
    """`overrides` over `base`, a dict value merged into a dict one (vLLM's rule)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _token_ids(tokenizer_dir: Path, tokens: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or (i == tokenizer.unk_token_id and t != tokenizer.unk_token)]
    if unknown:
        raise ValueError(f"hf_overrides: classifier_from_token {unknown} are not tokens of the model's vocabulary")
    return ids


def _write_score_head(model_dir: Path, config: dict, method: str, ids: list[int], out: Path) -> None:
    """The classifier's head from the language-model head's rows (the embedding's, where tied or
    where the checkpoint has no head of its own), in float32."""
    import safetensors.torch
    import torch
    from safetensors import safe_open

    names = ([] if config.get("tie_word_embeddings") else ["lm_head.weight"]) + ["model.embed_tokens.weight",
                                                                                  "embed_tokens.weight"]
    found: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in set(names).intersection(f.keys()):
                table = f.get_slice(name)
                found[name] = torch.cat([table[i:i + 1] for i in ids]).to(torch.float32)
    rows = next((found[n] for n in names if n in found), None)
    if rows is None:
        raise ValueError(f"hf_overrides: {model_dir} has no language-model head (lm_head.weight, or a tied "
                         "embed_tokens.weight) to make the classifier from")
    head = rows[1:2] - rows[0:1] if method == "from_2_way_softmax" else rows
    safetensors.torch.save_file({"score.weight": head.contiguous()}, str(out))
