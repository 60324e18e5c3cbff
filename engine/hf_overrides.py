"""vLLM's `--hf-overrides` (`LLM(hf_overrides=...)`): fields set over the model's config.json, as
if the folder said them. The engine reads the model from a view of its folder, made once per
cache by `engine.model_source.model_dir` (the driver, a replica, the engine-core process each
resolve it; tensor-parallel ranks get the driver's path, on its node):

    $KVSERVE_CACHE/overrides/<digest>/<model folder's name>/
        config.json            the folder's, with the overrides set over it (a sub-config such as
                               text_config merged key by key, any other value replaced whole)
        score.safetensors      a converted classifier's head (below), where one is asked for
        kvserve_source.json    the folder (its files' sizes and times), tokenizer and overrides it
                               was made from, so a stale view is made again
        every other file       a link to the folder's own

A causal LM made a classifier (vLLM's `classifier_from_token`, in the overrides or the folder's
own config): the config names a `...ForSequenceClassification` architecture and the tokens whose
language-model head rows make the classifier's head, e.g. Qwen3-Reranker's, as vLLM's docs give
them:

    {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
     "is_original_qwen3_reranker": true}

    from_2_way_softmax   two tokens (false, true): one label, the head row true - false, so the
                         score's sigmoid is the softmax of "yes" over the two (Qwen3-Reranker's
                         own formula; `is_original_qwen3_reranker` always takes it)
    no_post_processing   one label per token, its row as it is

Such a classifier reads a pair's two texts joined (`use_pad_token` false, vLLM's default for an
LLM made a reranker); its prompts are formatted by the caller, as with vLLM."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.vllm_args import json_dict

METHODS = ("from_2_way_softmax", "no_post_processing")
_CONVERSION_KEYS = ("method", "classifier_from_token", "is_original_qwen3_reranker")
_FORMAT = 1
_SOURCE_FILE = "kvserve_source.json"
_SCORE_FILE = "score.safetensors"


def parse_hf_overrides(value) -> dict:
    """--hf-overrides (a dict, or its JSON) -> the dict, as config.json would hold it (tuples as
    lists); ValueError naming what is not taken."""
    if value is None:
        return {}
    value = json_dict("hf_overrides", value)
    bad = [k for k in value if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"hf_overrides: its keys are config.json field names (strings), got {bad!r}")
    try:
        value = json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"hf_overrides: {e}") from None
    _conversion(value)  # the conversion keys' values; whether the model converts is known once its folder is read
    return value


def _conversion(config: dict) -> tuple[str, list[str]] | None:
    """(method, tokens) where a config (the folder's with the overrides) makes a causal LM's
    head rows a classifier's; is_original_qwen3_reranker always takes from_2_way_softmax (vLLM's)."""
    tokens = config.get("classifier_from_token")
    method = "from_2_way_softmax" if config.get("is_original_qwen3_reranker") else config.get("method")
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


def overridden_dir(model_dir: Path, overrides: dict, find_tokenizer: Callable[[], Path]) -> Path:
    """The view of `model_dir` with `overrides` (parse_hf_overrides') applied, made once per
    cache (again where the folder, its tokenizer or the overrides changed); `model_dir` itself
    where there are none and its own config asks no conversion. `find_tokenizer`: where a
    conversion's tokens are looked up."""
    config = json.loads((model_dir / "config.json").read_text())
    merged = _merged(config, overrides)
    arch = merged.get("architectures")
    classifies = isinstance(arch, list) and len(arch) == 1 and str(arch[0]).endswith("ForSequenceClassification")
    asked = any(key in overrides for key in _CONVERSION_KEYS)  # a folder's own keys count for a classifier only
    conversion = _conversion(merged) if asked or classifies else None
    if not overrides and conversion is None:
        return model_dir
    if conversion is not None and not classifies:
        raise ValueError("hf_overrides: classifier_from_token makes a classifier; give its architecture too, as "
                         '"architectures": ["Qwen3ForSequenceClassification"]')
    tokenizer_dir = find_tokenizer() if conversion is not None else None
    source = {"format": _FORMAT, "model": str(model_dir), "overrides": overrides, "config": config,
              "files": _stats(model_dir), "tokenizer": [str(tokenizer_dir), _stats(tokenizer_dir)]
              if conversion is not None else None}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    from engine.model_source import ModelError, cache_dir, remove_stale_partials

    target = cache_dir() / "overrides" / digest / model_dir.name
    if _is_made(target, source):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as e:
        raise ModelError(f"cannot write the view of the model that hf_overrides asks for under {target.parent}: "
                         f"{e.strerror or e}; set KVSERVE_CACHE to a writable folder") from None
    try:
        _make_view(model_dir, merged, conversion, tokenizer_dir, tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        tmp.chmod(0o755)
        for attempt in range(2):
            try:
                tmp.rename(target)
                break
            except OSError:
                if _is_made(target, source):  # another process made it first: use theirs
                    break
                if attempt:
                    raise
                shutil.rmtree(target, ignore_errors=True)  # a damaged view: made again
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _stats(folder: Path) -> dict[str, list[int]]:
    """Each file's size and modification time: a file replaced makes another view."""
    stats = {f.name: f.stat() for f in sorted(folder.iterdir()) if f.is_file()}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def _is_made(target: Path, source: dict) -> bool:
    try:
        return json.loads((target / _SOURCE_FILE).read_text()) == source
    except (OSError, ValueError):
        return False


def _make_view(model_dir: Path, config: dict, conversion: tuple[str, list[str]] | None, tokenizer_dir: Path,
               out: Path) -> None:
    own = {"config.json", _SOURCE_FILE}
    if conversion is not None:
        method, tokens = conversion
        _write_score_head(model_dir, config, method, tokens, _token_ids(tokenizer_dir, tokens), out / _SCORE_FILE)
        own.add(_SCORE_FILE)
        for key in _CONVERSION_KEYS:
            config.pop(key, None)
        n = 1 if method == "from_2_way_softmax" else len(tokens)
        labels = {str(i): f"LABEL_{i}" if n == 1 else tokens[i] for i in range(n)}
        config.update(num_labels=n, id2label=labels, label2id={v: int(k) for k, v in labels.items()})
        config.setdefault("use_pad_token", False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in model_dir.iterdir():
        if f.name not in own:
            os.symlink(f.resolve(), out / f.name)


def _merged(base: dict, overrides: dict) -> dict:
    """`overrides` over `base`, a value replaced whole, but a sub-config (`text_config`, ...)
    merged key by key (vLLM's rule)."""
    out = dict(base)
    for key, value in overrides.items():
        merge = key.endswith("_config") and isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if merge else value
    return out


def _token_ids(tokenizer_dir: Path, tokens: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or (i == tokenizer.unk_token_id and t != tokenizer.unk_token)]
    if unknown:
        raise ValueError(f"hf_overrides: classifier_from_token {unknown} are not tokens of the model's vocabulary")
    return ids


def _write_score_head(model_dir: Path, config: dict, method: str, tokens: list[str], ids: list[int],
                      out: Path) -> None:
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
            if {"lm_head.qweight", "lm_head.weight_packed"} & set(f.keys()):
                raise ValueError("hf_overrides: classifier_from_token reads the language-model head's rows, and this "
                                 "checkpoint's head is quantized (packed): not supported")
            for name in set(names).intersection(f.keys()):
                table = f.get_slice(name)
                beyond = [(t, i) for t, i in zip(tokens, ids) if i >= table.get_shape()[0]]
                if beyond:
                    raise ValueError(f"hf_overrides: classifier_from_token {beyond} (token, id): past the "
                                     f"{table.get_shape()[0]} rows of {name} (the tokenizer does not fit the model)")
                found[name] = torch.cat([table[i:i + 1] for i in ids]).to(torch.float32)
    rows = next((found[n] for n in names if n in found), None)
    if rows is None:
        raise ValueError(f"hf_overrides: {model_dir} has no language-model head (lm_head.weight, or a tied "
                         "embed_tokens.weight) to make the classifier from")
    head = rows[1:2] - rows[0:1] if method == "from_2_way_softmax" else rows
    safetensors.torch.save_file({"score.weight": head.contiguous()}, str(out))
