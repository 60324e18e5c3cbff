"""A vLLM command line, as kvserve's parser reads it. `vllm serve` takes spellings argparse does
not, and deployments moved from vLLM carry them:

- `--config FILE.yaml`: the file's keys are flags (`port: 8000`, `tensor-parallel-size: 2`), put
  between the sub-command (and its first argument: `serve`'s model, `generate`'s prompt) and the
  rest, so a flag on the command line wins over the file, and the file over the defaults (a model
  given to `serve` wins over the file's). `true` gives the flag, `false` its `--no-` form where it
  has one (else nothing), a list the flag and its items, a mapping the flag and its JSON.
- `--max_num_seqs=8` is `--max-num-seqs=8`: only a flag's name changes, never a value.
- `--speculative-config.num_speculative_tokens 3` (or `=3`) sets one key of a JSON flag; a value
  is read as JSON where it parses (else it is the string); `--X.key+ a,b` appends to a list. The
  keys of one flag are merged, over the flag's last whole JSON value where it has one.

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
    command = rest[0] if rest and not rest[0].startswith("-") else None
    flags = _config_flags(path, has_flag, f"kvserve {command}" if command else "kvserve")
    # after the sub-command and its first argument (a nargs="+" flag from the file must not take
    # it as one of its values); `serve MODEL` wins over the file's model
    at = 0 if command is None else 1
    if len(rest) > at and not rest[at].startswith("-"):
        at += 1
        if command == "serve":
            flags = [f for f in flags if not f.startswith("--model=")]
    return rest[:at] + flags + rest[at:]


def _config_flags(path: str, has_flag: Callable[[str], bool], command: str) -> list[str]:
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
        name, dot, keys = str(key).partition(".")
        flag = "--" + name.replace("_", "-") + dot + keys  # a dotted key: one key of a JSON flag
        if not has_flag("--" + name.replace("_", "-")):
            raise ValueError(f"--config {path}: {key!r} is not a flag of `{command}` (`{command} --help` lists them)")
        if dot:  # its value as JSON, whatever its type
            flags.append(f"{flag}={json.dumps(value)}")
        elif isinstance(value, bool):
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
            flags.append(f"{flag}={value}")  # one token: a value may start with "-"
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
    """`--X.a.b V` (or `--X.a.b=V`) -> `--X '{"a": {"b": V}}'`; `--X.a+ v,w` appends v and w to
    the list at a. The keys of one X are merged over X's last whole JSON value (`--X '{...}'`,
    from a config file say) where it has one, and X's JSON goes last, where it wins as vLLM's
    does. ValueError for a key with no value or no flag name."""
    out: list[str] = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        i += 1
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ValueError(f"{arg} needs a value")
            value, i = argv[i], i + 1
        flag, *keys = name.split(".")
        if flag == "--" or not all(keys):
            raise ValueError(f"{name}: a flag and keys are needed, as in --speculative-config.method")
        node = merged.setdefault(flag, {})
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        last = keys[-1]
        if last.endswith("+"):  # vLLM's list form
            last, items = last[:-1], value.split(",")
            node[last] = (node[last] if isinstance(node.get(last), list) else []) + items
        else:
            node[last] = _json_or_text(value)
    rest = argv[i:]
    for flag, keys in merged.items():
        base, out = _take_whole(out, flag)
        out += [flag, json.dumps(_deep_merge(base, keys))]
    return out + rest


def _take_whole(argv: list[str], flag: str) -> tuple[dict, list[str]]:
    """(the last whole JSON object `flag` was given, else {}; argv without `flag`'s values)."""
    base, out, i = {}, [], 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif argv[i].startswith(flag + "="):
            value, i = argv[i][len(flag) + 1:], i + 1
        else:
            out.append(argv[i])
            i += 1
            continue
        parsed = _json_or_text(value)
        base = parsed if isinstance(parsed, dict) else base
    return base, out


def _deep_merge(base: dict, keys: dict) -> dict:
    out = dict(base)
    for k, v in keys.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value
