"""A vLLM command line, as kvserve's parser reads it. `vllm serve` takes spellings argparse does
not, and deployments moved from vLLM carry them:

- `--config FILE.yaml`: the file's keys are flags (`port: 8000`, `tensor-parallel-size: 2`), put
  between the sub-command (and its model) and the rest, so a flag on the command line wins over
  the file, and the file over the defaults. `true` gives the flag, `false` its `--no-` form where
  it has one (else nothing), a list the flag and its items, a mapping the flag and its JSON.
- `--max_num_seqs=8` is `--max-num-seqs=8`: only a flag's name changes, never a value.
- `--speculative-config.num_speculative_tokens 3` (or `=3`) sets one key of a JSON flag; a value
  is read as JSON where it parses (else it is the string), and the keys of one flag are merged.

Nothing after a bare `--` changes.
"""
from __future__ import annotations

import json
from collections.abc import Callable


def expand_config(argv: list[str], has_flag: Callable[[str], bool]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags (see the module's docstring).
    `has_flag("--no-x")` says whether the parser knows a flag. ValueError for a file that cannot be read."""
    end = argv.index("--") if "--" in argv else len(argv)
    places = [i for i, arg in enumerate(argv[:end]) if arg == "--config" or arg.startswith("--config=")]
    if not places:
        return argv
    if len(places) > 1:
        raise ValueError("--config is given more than once")
    i = places[0]
    if argv[i] == "--config":
        if i + 1 >= end:
            raise ValueError("--config needs a file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    flags = _config_flags(path, has_flag)
    # after the sub-command and a model given as its first argument (a nargs="+" flag from the
    # file must not take the model as one of its values), which wins over the file's model
    at = 1 if rest and not rest[0].startswith("-") else 0
    if len(rest) > at and not rest[at].startswith("-"):
        at += 1
        if "--model" in flags:
            del flags[flags.index("--model"):flags.index("--model") + 2]
    return rest[:at] + flags + rest[at:]


def _config_flags(path: str, has_flag: Callable[[str], bool]) -> list[str]:
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config takes a YAML file (.yaml or .yml), not {path!r}")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read --config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must map flag names to values (e.g. `port: 8000`)")
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if not has_flag(flag):
            raise ValueError(f"--config {path}: {key!r} is not a kvserve flag")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif has_flag(no := "--no-" + flag[2:]):
                flags.append(no)
        elif isinstance(value, list):
            if value:
                flags += [flag] + [_text(v) for v in value]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _text(value) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def dashed_flags(argv: list[str]) -> list[str]:
    """`--max_num_seqs=8` -> `--max-num-seqs=8`: underscores in a flag's name (before any dot) become dashes."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            head, dot, keys = name[2:].partition(".")
            arg = "--" + head.replace("_", "-") + dot + keys + eq + value
        out.append(arg)
    return out


def dotted_json_flags(argv: list[str]) -> list[str]:
    """`--X.a.b V` (or `--X.a.b=V`) -> `--X '{"a": {"b": V}}'`, the keys of one X merged into one
    JSON flag at the place of its first key. ValueError for a key with no value."""
    out: list[str] = []
    merged: dict[str, dict] = {}
    slots: dict[str, int] = {}  # where each merged flag's JSON goes in out
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        name, eq, value = arg.partition("=")
        i += 1
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            continue
        if not eq:
            if i >= len(argv) or argv[i] == "--":
                raise ValueError(f"{arg} needs a value")
            value, i = argv[i], i + 1
        flag, *keys = name.split(".")
        if not all(keys):
            raise ValueError(f"{name}: an empty key")
        if flag not in merged:
            merged[flag], slots[flag] = {}, len(out) + 1
            out += [flag, ""]
        node = merged[flag]
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = _json_or_text(value)
    for flag, at in slots.items():
        out[at] = json.dumps(merged[flag])
    return out


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value
