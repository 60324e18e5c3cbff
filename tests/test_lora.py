"""LoRA adapters (engine.lora, --enable-lora): greedy output token-exact against PEFT's model on
the same base weights, alone and with the base model and other adapters in one batch, under
chunked prefill, preemption, the prefix cache and max_loras; adapters that cannot be served are
refused, naming why; the server's --lora-modules and runtime modules (router.lora_modules), and
the lora_requests_info gauge. Tensor parallel: tests/test_workers.py; through Ray Serve:
tests/test_router_server.py; the Triton runner: tests/test_triton_runner.py."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, LoRARequest, SamplingParams
from engine.errors import InvalidRequestError
from tests.test_engine_exact import _assert_clean
from tests.tiny_llama import make_tiny_llama
from tests.tiny_lora import make_adapter, peft_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    """kind -> (base dir, {adapter name: dir}, {adapter name or None: PEFT's greedy tokens}).
    "gqa": a1 adapts all seven projections (r 8), a2 only q and v (r 4, rsLoRA); "bias": every
    linear with a bias (the delta comes after it, as PEFT adds it); "qwen3-bf16": a tied head and
    bfloat16 weights, held as codes and prepacked only (engine.model.loader.drop_float_weight)."""
    out = {}
    for kind in ("gqa", "bias", "qwen3-bf16"):
        root = tmp_path_factory.mktemp(f"lora-{kind}")
        base = make_tiny_llama(root / "base", smollm2_path, kind)
        adapters = {"a1": make_adapter(base, root / "a1", seed=1)}
        if kind == "gqa":
            adapters["a2"] = make_adapter(base, root / "a2", ["q_proj", "v_proj"], r=4, alpha=8, seed=2,
                                          use_rslora=True)
        expected = {name: peft_greedy(base, path, PROMPTS, MAX_NEW) for name, path in [(None, None), *adapters.items()]}
        out[kind] = base, adapters, expected
    return out


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["gqa", "bias", "qwen3-bf16"])
def test_each_adapter_alone_is_peft_exact(models, kind):
    base, adapters, expected = models[kind]
    llm = LLM(model=str(base), enable_lora=True, num_gpu_blocks_override=128, max_model_len=256)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected[None]
    for name, lora in _requests(adapters).items():
        assert expected[name] != expected[None]  # the adapter changes the output, so the test can fail
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert _tokens(outs) == expected[name], name
        assert all(o.lora_request == lora for o in outs)  # as vLLM's RequestOutput names it
    _assert_clean(llm)


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=128),
    dict(num_gpu_blocks_override=128, max_num_batched_tokens=16, block_size=4),  # prompts in chunks beside decodes
    dict(num_gpu_blocks_override=16, max_num_batched_tokens=32, block_size=4),  # too few blocks: preemptions
], ids=["batch", "chunked", "preempted"])
def test_a_batch_mixes_the_base_model_and_adapters(models, engine_kwargs):
    base, adapters, expected = models["gqa"]
    reqs = _requests(adapters)
    names = [None, "a1", "a2", "a1", "a2"]
    llm = LLM(model=str(base), enable_lora=True, max_loras=2, max_model_len=256, **engine_kwargs)
    seen = _record_adapters(llm)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    assert _tokens(outs) == [expected[n][i] for i, n in enumerate(names)]
    assert {frozenset({1, 2}), frozenset({None, 1, 2})} & set(seen)  # both adapters in one step
    if engine_kwargs["num_gpu_blocks_override"] == 16:
        assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)


def _record_adapters(llm: LLM) -> list[frozenset]:
    """The adapter ids (None: the base model) of every step the engine runs, as they run."""
    ex, seen = llm.engine.executor, []
    execute = ex.execute

    def recording(batch, mask=None):
        seen.append(frozenset(s.params.lora_request and s.params.lora_request.lora_int_id for s in batch.seqs))
        return execute(batch, mask)

    ex.execute = recording
    return seen


def test_max_loras_bounds_the_adapters_of_a_step(models):
    """max_loras 1 (vLLM's default): requests of a second adapter wait, while those of the running
    adapter and of the base model go ahead of them; every output is still its adapter's."""
    base, adapters, expected = models["gqa"]
    reqs = _requests(adapters)
    names = ["a1", "a2", None, "a1", "a2"]
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128)
    seen = _record_adapters(llm)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    assert _tokens(outs) == [expected[n][i] for i, n in enumerate(names)]
    assert all(len(step - {None}) <= 1 for step in seen)
    assert seen[0] == {1, None}  # a2's first request waited; the base model's went ahead of it
    assert {2} <= set().union(*seen)
    _assert_clean(llm)


def test_the_prefix_cache_is_kept_apart_per_adapter(models):
    """The same prompt under the base model, then an adapter, then another: no one reads another's
    KV blocks, and the adapter's own repeat hits its own."""
    base, adapters, expected = models["gqa"]
    reqs = _requests(adapters)
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128, block_size=4)
    prompt = [PROMPTS[4]]
    for name in (None, "a1", "a2"):
        hits = llm.engine.stats().prefix_hit_tokens
        assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reqs.get(name))) == [expected[name][4]]
        assert llm.engine.stats().prefix_hit_tokens == hits, name
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reqs["a1"])) == [expected["a1"][4]]
    assert llm.engine.stats().prefix_hit_tokens > hits
    _assert_clean(llm)


def test_loaded_adapters_are_bounded_by_max_cpu_loras(models):
    base, adapters, expected = models["gqa"]
    reqs = _requests(adapters)
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128)  # max_cpu_loras 1
    held = llm.engine.executor.model.lora.adapters
    for name in ("a1", "a2", "a1"):
        assert _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=reqs[name])) == expected[name][:2]
        assert list(held) == [reqs[name].lora_int_id]
    # Both at once: the one in use stays, beyond the bound, until its requests end.
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[reqs["a1"], reqs["a2"]])
    assert _tokens(outs) == [expected["a1"][0], expected["a2"][1]]
    _assert_clean(llm)


def test_beam_search_and_chat_take_an_adapter(models):
    base, adapters, expected = models["gqa"]
    lora = _requests(adapters)["a1"]
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128)
    from engine import BeamSearchParams

    with_adapter = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=6),
                                   lora_request=lora)
    without = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=6))
    assert with_adapter[0].sequences[0].tokens != without[0].sequences[0].tokens
    _assert_clean(llm)


def test_what_cannot_be_served_is_refused(models, tmp_path):
    base, adapters, _ = models["gqa"]
    a1 = adapters["a1"]
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    plain = LLM(model=str(base), max_model_len=256, num_gpu_blocks_override=64)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a1", 1, a1))
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a1", 0, a1)

    llm = LLM(model=str(base), enable_lora=True, max_lora_rank=4, max_model_len=256, num_gpu_blocks_override=64)

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
        _assert_clean(llm)

    refused(LoRARequest("a1", 1, a1), "rank 8 is more than --max-lora-rank 4")
    refused(LoRARequest("none", 2, str(tmp_path / "missing")), "no adapter_config.json")
    dora = Path(make_adapter(base, tmp_path / "dora", r=4, use_dora=True))
    refused(LoRARequest("dora", 3, str(dora)), "DoRA")
    # adapters made for other models: more layers, other shapes
    deeper = make_tiny_llama(tmp_path / "deeper", str(Path(base)), "tied")
    refused(LoRARequest("deeper", 4, make_adapter(deeper, tmp_path / "deeper-a", r=4)), "this model has 2 layers")
    wider = make_tiny_llama(tmp_path / "wider", str(Path(base)), "qwen3")
    refused(LoRARequest("wider", 4, make_adapter(wider, tmp_path / "wider-a", r=4)),
            r"layer 0's o_proj has A \(4, 128\) and B \(64, 4\), where this model needs \(4, 64\) and \(64, 4\)")
    embed = Path(make_adapter(base, tmp_path / "embed", ["embed_tokens", "q_proj"], r=4))
    refused(LoRARequest("embed", 5, str(embed)), r"its target_modules \['embed_tokens'\] are not modules kvserve adapts")
    config = json.loads((embed / "adapter_config.json").read_text())  # a regex that says nothing of them: the weights do
    (embed / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ".*"}))
    refused(LoRARequest("embed", 5, str(embed)), "adapts nothing kvserve's model can")
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": "16"}))
    (tmp_path / "alpha" / "adapter_model.safetensors").write_bytes(b"")
    refused(LoRARequest("alpha", 6, str(tmp_path / "alpha")), "its lora_alpha must be a number, got '16'")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    refused(LoRARequest("bad", 6, str(tmp_path / "bad")), "cannot read adapter_model.safetensors")
    # an id already loaded from another directory
    a2 = adapters["a2"]
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a2", 7, a2)))
    refused(LoRARequest("a2-again", 7, str(dora)), "each adapter needs its own lora_int_id")


def test_the_server_runs_the_adapter_a_request_names(models):
    """--lora-modules: `model` names an adapter (vLLM's); /v1/models lists it with its directory
    and base model; replies and chunks name it; another name is a 404."""
    import openai

    from engine.lora_request import lora_modules
    from tests.tiny_app import serve_tiny

    base, adapters, expected = models["gqa"]
    modules = lora_modules([f"{name}={path}" for name, path in sorted(adapters.items())], max_rank=16)
    extra = {"ignore_eos": True, "return_token_ids": True}

    async def go(client, server):
        cards = {m.id: m for m in (await client.models.list()).data}
        assert list(cards) == ["m", "a1", "a2"]
        assert (cards["a1"].root, cards["a1"].parent, cards["m"].parent) == (adapters["a1"], "m", None)
        for name in (None, "a1", "a2"):
            r = await client.completions.create(model=name or "m", prompt=PROMPTS[1], max_tokens=MAX_NEW,
                                                temperature=0, extra_body=extra)
            assert r.model == (name or "m") and r.model_dump()["choices"][0]["token_ids"] == expected[name][1]
        stream = await client.completions.create(model="a2", prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, extra_body=extra)
        chunks = [c async for c in stream]
        assert {c.model for c in chunks} == {"a2"}
        assert [t for c in chunks for t in c.model_dump()["choices"][0]["token_ids"]] == expected["a2"][2]
        try:
            await client.completions.create(model="a3", prompt="hi", max_tokens=2)
        except openai.NotFoundError as e:
            assert e.body["code"] == "model_not_found"
        else:
            raise AssertionError("an unknown model name was served")
        return server

    serve_tiny(str(base), go, engine_kwargs=dict(enable_lora=True, max_loras=2),
               settings_kwargs=dict(lora_modules=modules))


def test_lora_modules_are_checked_at_start_up(models, tmp_path):
    from cluster.app import ServeOptions, router_settings, split_args
    from cluster.cli import build_parser
    from engine.lora_request import lora_modules

    base, adapters, _ = models["gqa"]
    a1 = adapters["a1"]
    spec = json.dumps({"name": "sql", "path": a1, "base_model_name": "base"})
    assert lora_modules([f"x={a1}", spec]) == (LoRARequest("x", 1, a1), LoRARequest("sql", 2, a1, "base"))
    for specs, says in [([f"x={a1}", f"x={a1}"], "names 'x' twice"), (["x"], "takes name=path"),
                        (["{not json"], "not JSON"), ([f"x={tmp_path}"], "x: LoRA adapter .* no adapter_config.json")]:
        with pytest.raises(ValueError, match=says):
            lora_modules(specs)
    with pytest.raises(ValueError, match="rank 8 is more than --max-lora-rank 4"):
        lora_modules([f"x={a1}"], max_rank=4)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="x: LoRA adapter .* adapter_model.safetensors is not safetensors"):
        lora_modules([f"x={broken}"])
    # a weights file cut short (a copy that did not finish), and target_modules no model layer has
    cut = tmp_path / "cut"
    shutil.copytree(a1, cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="x: LoRA adapter .* adapter_model.safetensors is cut short or damaged: "
                                         "its header lists \\d+ bytes of tensors, the file holds \\d+"):
        lora_modules([f"x={cut}"])
    foreign = tmp_path / "foreign"
    shutil.copytree(a1, foreign)
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "foo_proj"]}))
    with pytest.raises(ValueError, match=r"its target_modules \['foo_proj'\] are not modules kvserve adapts"):
        lora_modules([f"x={foreign}"])
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["self_attn.q_proj"]}))
    assert lora_modules([f"x={foreign}"])  # PEFT's suffixes, and a regex string, are taken
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ".*(q|v)_proj"}))
    assert lora_modules([f"x={foreign}"])
    with pytest.raises(ValueError, match="needs the engine's enable_lora"):
        router_settings(EngineConfig(model=str(base)), ServeOptions(lora_modules=[f"x={a1}"]))
    # adapters made for other models, refused at start-up by their weights' header against the model's config
    lora_base = EngineConfig(model=str(base), enable_lora=True)
    deeper = make_adapter(make_tiny_llama(tmp_path / "deeper", str(Path(base)), "tied"), tmp_path / "deeper-a", r=4)
    with pytest.raises(ValueError, match=r"x: LoRA adapter .* tensor '.*layers\.2\..*' adapts layer 2, and this "
                                         "model has 2 layers"):
        router_settings(lora_base, ServeOptions(lora_modules=[f"x={deeper}"]))
    wider = make_adapter(make_tiny_llama(tmp_path / "wider", str(Path(base)), "qwen3"), tmp_path / "wider-a", r=4)
    with pytest.raises(ValueError, match=r"x: LoRA adapter .* tensor '.*layers\.0\.self_attn\.(q|k|v|o)_proj\.lora_"
                                         r"(A|B)\.weight' has shape \(\d+, \d+\), where this model needs"):
        router_settings(lora_base, ServeOptions(lora_modules=[f"x={wider}"]))
    assert lora_modules([f"x={deeper}"], max_rank=16)  # without the model's dims, the engine's first use finds it
    other_rank = tmp_path / "other-rank"  # a config whose r is not the weights'
    shutil.copytree(a1, other_rank)
    (other_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(ValueError, match=r"has shape \(8, 128\), where this model needs \(4, 128\)"):
        router_settings(lora_base, ServeOptions(lora_modules=[f"x={other_rank}"]))
    assert router_settings(lora_base, ServeOptions(lora_modules=[f"x={a1}"])).lora_modules == (LoRARequest("x", 1, a1),)
    with pytest.raises(ValueError, match="must differ from the served model names"):
        router_settings(EngineConfig(model=str(base), enable_lora=True),
                        ServeOptions(served_model_name="x", lora_modules=[f"x={a1}"]))
    # a serveConfigV2's args (deploy/k8s): dicts, as YAML gives them
    engine, options = split_args({"model": str(base), "enable_lora": "true", "lora_modules": [{"name": "sql", "path": a1}]})
    assert router_settings(engine, options).lora_modules == (LoRARequest("sql", 1, a1),)
    args = build_parser().parse_args(["serve", "--model", str(base), "--enable-lora", "--max-loras", "2",
                                      "--lora-modules", f"a1={a1}", spec])
    assert (args.enable_lora, args.max_loras, args.lora_modules) == (True, 2, [f"a1={a1}", spec])


def test_the_benchmarks_random_adapter_is_served(models, tmp_path):
    """benchmarks/offline.py's kvserve-lora runs on adapters benchmarks/random_model.py writes in
    PEFT's format, without peft: PEFT reads them as kvserve does."""
    from benchmarks.random_model import make_random_adapter

    base = models["gqa"][0]
    adapter = make_random_adapter(tmp_path / "bench-a", Path(base), rank=8)
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=64)
    got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("b", 1, str(adapter))))
    assert got == peft_greedy(base, adapter, PROMPTS, MAX_NEW)
    assert got != models["gqa"][2][None]  # it changes what the model says


def test_lora_requests_info_names_the_running_and_waiting_adapters(models):
    """vLLM's lora_requests_info gauge: which adapters run and wait, and max_lora."""
    base, adapters, _ = models["gqa"]
    reqs = _requests(adapters)
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128,
              disable_log_stats=False)
    for i, name in enumerate(["a1", "a2", None]):
        llm.engine.add_request(f"r{i}", PROMPTS[i], dataclasses.replace(GREEDY, lora_request=reqs.get(name)))
    outs = llm.engine.step()  # the engine's own outputs name the adapter too (AsyncEngine streams them)
    assert {o.request_id: o.lora_request for o in outs} == {"r0": reqs["a1"], "r2": None}
    info = [m for m in llm.get_metrics() if m.name == "kvserve_lora_requests_info"]
    assert [m.labels | {"model_name": None} for m in info] == [{
        "model_name": None, "running_lora_adapters": "a1", "waiting_lora_adapters": "a2", "max_lora": "1"}]
    assert time.time() - 60 < info[0].value <= time.time()
    waiting = {m.labels["reason"]: m.value for m in llm.get_metrics() if m.name == "kvserve_num_requests_waiting_by_reason"}
    assert waiting == {"deferred": 1, "capacity": 0}  # a2's request waits for a1's to end (vLLM's reason)
    while llm.engine.has_unfinished():
        llm.engine.step()
    plain = LLM(model=str(base), max_model_len=256, num_gpu_blocks_override=64, disable_log_stats=False)
    plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not [m for m in plain.get_metrics() if m.name == "kvserve_lora_requests_info"]


def test_an_adapters_cache_is_its_own_whatever_the_ids_and_salts(models, tmp_path, monkeypatch):
    """No other request's blocks reach an adapter's: not a base-model request whose cache_salt
    spells the adapter's key, nor another directory that once had its id (offline callers pick the
    ids); one directory, named relative or absolute, is one adapter."""
    from engine.hashing import request_root, root_hash

    base, adapters, expected = models["gqa"]
    a1, a2 = adapters["a1"], adapters["a2"]
    llm = LLM(model=str(base), enable_lora=True, max_model_len=256, num_gpu_blocks_override=128, block_size=4)
    prompt = [PROMPTS[4]]
    one = LoRARequest("a1", 1, a1)
    for salt in ["None\x00lora:1", f'[null, 1, "{a1}"]', json.dumps([None, 1, a1])]:
        assert root_hash(salt) != request_root(SamplingParams(lora_request=one))
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, cache_salt=salt), use_tqdm=False)
    hits = llm.engine.stats().prefix_hit_tokens
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=one)) == [expected["a1"][4]]
    assert llm.engine.stats().prefix_hit_tokens == hits
    # id 1 again, from a2's directory, once a1 is unloaded (max_cpu_loras 1): a2's output, no a1 block
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 2, a2))
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("a2", 1, a2))) == \
        [expected["a2"][4]]
    assert llm.engine.stats().prefix_hit_tokens == hits
    monkeypatch.chdir(Path(a2).parent)
    relative = LoRARequest("a2", 1, Path(a2).name)
    assert relative.lora_path == a2
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=relative)) == [expected["a2"][4]]
    _assert_clean(llm)


def test_loaded_adapters_come_back_under_max_cpu_loras_at_the_next_use(models):
    base, adapters, expected = models["gqa"]
    reqs = _requests(adapters)
    llm = LLM(model=str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_model_len=256,
              num_gpu_blocks_override=128)
    third = LoRARequest("a3", 3, adapters["a1"] + "/")  # a1's directory again, under another id
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[reqs["a1"], reqs["a2"], third])
    held = llm.engine.executor.model.lora.adapters
    assert len(held) == 3  # all three ran together: none could go
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["a2"])) == expected["a2"][:1]
    assert sorted(held) == [2, 3]


def test_adapters_load_and_unload_at_run_time(models, tmp_path):
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    a loaded adapter serves at once; load_inplace gives the name another directory, whose output
    (not the old one's cached blocks) it then serves; an unloaded name is a 404; what cannot be
    served is a 400 naming why."""
    import openai

    from tests.tiny_app import serve_tiny

    base, adapters, expected = models["gqa"]
    extra = {"ignore_eos": True, "return_token_ids": True}

    async def go(client, server):
        async def post(path: str, body: dict) -> str:
            return await client.post(path, body=body, cast_to=str)

        async def tokens(model: str) -> list[int]:
            r = await client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=MAX_NEW, temperature=0,
                                                extra_body=extra)
            return r.model_dump()["choices"][0]["token_ids"]

        async def refused(path: str, body: dict, status: int, says: str) -> None:
            try:
                await post(path, body)
            except openai.APIStatusError as e:
                assert (e.status_code, says in e.message) == (status, True), e.message
            else:
                raise AssertionError(f"{path} {body} was taken")

        assert await post("/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["a1"]}) == \
            "Success: LoRA adapter 'x' added successfully."
        assert [m.id for m in (await client.models.list()).data] == ["m", "x"]
        assert await tokens("x") == expected["a1"][3]
        await refused("/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["a2"]}, 400,
                      "The lora adapter 'x' has already been loaded.")
        await post("/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["a2"], "load_inplace": True})
        assert await tokens("x") == expected["a2"][3]
        await refused("/load_lora_adapter", {"lora_name": "m", "lora_path": adapters["a1"]}, 400, "served model's")
        await refused("/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path)}, 400,
                      "no adapter_config.json")
        await refused("/load_lora_adapter", {"lora_name": "y"}, 400, "lora_path")
        await refused("/load_lora_adapter", {"lora_name": "y", "lora_path": wider}, 400, "where this model needs")
        assert "y" not in [m.id for m in (await client.models.list()).data]
        assert await post("/unload_lora_adapter", {"lora_name": "x"}) == "Success: LoRA adapter 'x' removed successfully."
        await refused("/completions", {"model": "x", "prompt": "hi", "max_tokens": 1}, 404, "does not exist")
        await refused("/unload_lora_adapter", {"lora_name": "x"}, 404, "The lora adapter 'x' cannot be found.")

    from engine.lora_request import ModelDims
    from engine.model.loader import load_arch

    wider = make_adapter(make_tiny_llama(tmp_path / "wider", str(Path(base)), "qwen3"), tmp_path / "wider-a", r=4)
    serve_tiny(str(base), go, engine_kwargs=dict(enable_lora=True, max_cpu_loras=2),
               settings_kwargs=dict(allow_runtime_lora_updating=True, lora_dims=ModelDims.of(load_arch(base)[0])))

    async def off(client, server):  # not allowed: vLLM's server has no such routes then
        try:
            await client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": adapters["a1"]}, cast_to=str)
        except openai.NotFoundError:
            return
        raise AssertionError("runtime LoRA loading was on")

    serve_tiny(str(base), off, engine_kwargs=dict(enable_lora=True))


def test_runtime_modules_get_ids_no_registry_gave_before(models):
    """An ingress replica that restarts starts a new registry, while the engine replicas keep the
    adapters they loaded by id: a module loaded at run time takes a random id above the
    --lora-modules' own, never one an engine replica already holds for another directory."""
    import asyncio

    from router.lora_modules import RUNTIME_IDS, LoadLoRAAdapterRequest, LoRAModules

    adapters = models["gqa"][1]
    static = (LoRARequest("s", 1, adapters["a1"]),)

    async def load(name: str, path: str) -> int:
        modules = LoRAModules(static, ("m",), 16)  # a fresh registry each time, as after a restart
        await modules.load(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
        return modules.get(name).lora_int_id

    ids = [asyncio.run(load(name, adapters[path])) for name, path in (("x", "a1"), ("y", "a2"), ("x", "a1"))]
    assert len(set(ids)) == 3 and min(ids) >= RUNTIME_IDS


def test_runtime_lora_updating_is_checked_at_start_up(models, monkeypatch):
    from cluster.app import ServeOptions, router_settings

    base = str(models["gqa"][0])
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    settings = router_settings(EngineConfig(model=base, enable_lora=True, max_lora_rank=32), ServeOptions())
    assert (settings.allow_runtime_lora_updating, settings.max_lora_rank) == (True, 32)
    with pytest.raises(ValueError, match="needs the engine's enable_lora"):
        router_settings(EngineConfig(model=base), ServeOptions())
    with pytest.raises(ValueError, match="needs one ingress replica"):
        router_settings(EngineConfig(model=base, enable_lora=True), ServeOptions(num_ingress_replicas=2))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not router_settings(EngineConfig(model=base), ServeOptions()).allow_runtime_lora_updating
