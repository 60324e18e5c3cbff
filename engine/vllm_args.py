"""vLLM engine arguments with nothing to set in kvserve, so that a vLLM command line or `LLM(...)`
call runs unchanged: those taken only at the values that ask nothing kvserve lacks (any other
value is refused, saying why), and those that change nothing here. The CLI makes its flags from
this table (cluster.engine_args); the offline `LLM` takes the same keywords."""
from __future__ import annotations

import json

# name -> (the values taken, as the CLI spells them; why)
ONLY_AT = {
    "kv_cache_dtype": (("auto",), "the KV cache is in the model's dtype (vLLM's auto); fp8 caches are not implemented"),
    "pipeline_parallel_size": (("1",), "1: replicas shard by tensor parallelism alone"),
    "tokenizer_mode": (("auto", "hf"), "transformers' tokenizer (vLLM's auto)"),
}
# name -> why it changes nothing
NO_EFFECT = {
    "disable_custom_all_reduce": "tensor parallelism all-reduces with torch.distributed (NCCL, gloo), no custom kernel",
    "max_seq_len_to_capture": "the decode CUDA graphs replay at any context length",
    "swap_space": "preempted sequences are recomputed (as in vLLM V1), not swapped to CPU memory",
    "async_scheduling": "each step is scheduled after the last one's tokens; the outputs are the same",
    "hf_token": "models come from local folders or the local Hugging Face cache: nothing is downloaded",
}


# vLLM `LLM(...)` keywords with no CLI flag here, taken at the values that ask nothing (vLLM's
# defaults); name -> (the values taken, None always; what kvserve lacks).
AT_DEFAULT = {
    "task": (("auto", "generate"), "vLLM's older name: give runner='pooling' (--runner pooling) to embed"),
    "cpu_offload_gb": ((0,), "weights stay on the device"),
    "skip_tokenizer_init": ((False,), "the engine detokenizes with the model's tokenizer"),
    "enable_sleep_mode": ((False,), "no sleep mode"),
    "mm_processor_kwargs": (({},), "text models only"),
    "kv_transfer_config": (({},), "no disaggregated prefill"),
    "data_parallel_size": ((1,), "one engine per LLM; a server's engine replicas are its data parallelism "
                                 "(`kvserve serve -dp N`)"),
    "model_impl": (("auto", "vllm"), "kvserve runs its own model code"),
    "worker_cls": (("auto",), "kvserve's own workers"),
    "config_format": (("auto", "hf"), "the model's config.json"),
    "enable_expert_parallel": ((False,), "no mixture-of-experts models"),
    "enable_return_routed_experts": ((False,), "no mixture-of-experts models"),
}
# the same, that change nothing here; name -> why
AT_ANY = {
    "compilation_config": "no torch.compile; CUDA graphs for decode steps unless enforce_eager",
    "limit_mm_per_prompt": "text models: no multi-modal inputs to limit",
}
# vLLM's structured_outputs_config: its keys and what each may be here. One backend, llguidance,
# serves every backend's requests and a schema's objects are closed (what disable_additional_properties
# asks); disable_any_whitespace is a request's own option here (structured_outputs), so only the
# reasoning keys change anything (router.settings).
STRUCTURED_OUTPUTS_KEYS = {
    "backend": ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"),
    "disable_fallback": (True, False), "disable_any_whitespace": (True, False),
    "disable_additional_properties": (True, False), "enable_in_reasoning": (True, False),
    "reasoning_parser": None, "reasoning_parser_plugin": ("",),  # None: any string
}
# vLLM's shorthands for keys of speculative_config: --spec-method, --spec-model, --spec-tokens
SPEC_SHORTHANDS = {"spec_method": "method", "spec_model": "model", "spec_tokens": "num_speculative_tokens"}


def refused(name: str, value) -> str | None:
    """Why `name=value` cannot be taken (an ONLY_AT argument at another value), else None."""
    if name in ONLY_AT and str(value) not in ONLY_AT[name][0]:
        values, why = ONLY_AT[name]
        return f"only {' or '.join(values)} here, not {value!r} ({why})"
    return None


def json_dict(name: str, value) -> dict:
    """A config argument given as a dict or its JSON (a flag's), as a dict; ValueError naming it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name}: not JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or its JSON, got {value!r}")
    return value


def structured_outputs_config(value) -> dict:
    """vLLM's structured_outputs_config (a dict or its JSON), checked against
    STRUCTURED_OUTPUTS_KEYS; ValueError naming the key and what it may be."""
    value = json_dict("structured_outputs_config", value)
    for key, given in value.items():
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise ValueError(f"structured_outputs_config: {key!r} is not one of its keys "
                             f"({', '.join(STRUCTURED_OUTPUTS_KEYS)})")
        allowed = STRUCTURED_OUTPUTS_KEYS[key]
        ok = isinstance(given, str) if allowed is None else type(given) is type(allowed[0]) and given in allowed
        if not ok:
            shown = "a string" if allowed is None else " or ".join(map(json.dumps, allowed))
            raise ValueError(f"structured_outputs_config: {key} must be {shown} here, got {given!r}")
    return dict(value)


def with_spec_shorthands(kwargs: dict) -> dict:
    """`kwargs` with SPEC_SHORTHANDS' arguments put into speculative_config (a dict, its JSON or
    None), as vLLM does; ValueError where both give one key, as vLLM's."""
    given = {key: kwargs[name] for name, key in SPEC_SHORTHANDS.items() if kwargs.get(name) is not None}
    kwargs = {k: v for k, v in kwargs.items() if k not in SPEC_SHORTHANDS}
    if not given:
        return kwargs
    config = json_dict("speculative_config", kwargs.get("speculative_config") or {})
    for key in given.keys() & config.keys():
        flag = next(name for name, k in SPEC_SHORTHANDS.items() if k == key).replace("_", "-")
        raise ValueError(f"--{flag} and --speculative-config['{key}'] are mutually exclusive")
    return {**kwargs, "speculative_config": {**config, **given}}


def without_vllm_only(kwargs: dict) -> dict:
    """`kwargs` less the arguments of these tables, vLLM's speculative shorthands put into
    speculative_config; ValueError for one at a value kvserve cannot take."""
    kwargs = with_spec_shorthands(kwargs)
    if kwargs.get("structured_outputs_config") is not None:  # offline: no reasoning parser, nothing to set
        structured_outputs_config(kwargs["structured_outputs_config"])
    kwargs = {k: v for k, v in kwargs.items() if k != "structured_outputs_config"}
    for name, value in kwargs.items():
        if (why := refused(name, value)) is not None:
            raise ValueError(f"{name}: {why}")
        if name in AT_DEFAULT and value is not None and value not in AT_DEFAULT[name][0]:
            raise ValueError(f"{name}={value!r} is not supported: {AT_DEFAULT[name][1]}")
    return {k: v for k, v in kwargs.items() if k not in ONLY_AT and k not in NO_EFFECT and k not in AT_DEFAULT
            and k not in AT_ANY}
