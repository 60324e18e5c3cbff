"""Tensor-parallel worker groups (gloo on CPU): token-exact vs tp=1 and HF, weights read once and
scattered, step messages as deltas, clear errors, and a group that fails fast and can be rebuilt."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import torch

from engine import LLM, AsyncEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence
from tests.tiny_llama import TINY_CONFIGS, hf_greedy, make_tiny_classifier, make_tiny_llama
from workers.messages import RankMirror, StepEncoder

MAX_NEW = 24
PROMPT_LENS = (5, 16, 17, 40, 33, 100, 64)  # cross block boundaries (block_size 16)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# 4 heads over 1 KV head: with tp=2 the KV head is replicated; a vocab (509) that does not split evenly
# One KV head (replicated on every rank), as a Qwen3: per-head q/k norms (replicated too) and a
# head_dim of 32 where hidden / heads is 16.
MQA = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)


def _prompts(seed: int = 0, lens=PROMPT_LENS, vocab: int = 509) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# -- step messages: pure Python, driven by the real scheduler ----------------------------------

def _append_token(seq: Sequence, token: int) -> bool:
    seq.token_ids.append(token)
    return seq.num_output_tokens >= seq.max_tokens


def test_mirror_tracks_scheduler_through_preemption_forks_and_aborts():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=24, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20), bm)
    enc, mirror = StepEncoder(), RankMirror()
    copies = 0
    shared = [rng.randrange(100) for _ in range(9)]  # prefix-cache hits
    for step in range(400):
        if step < 250 and rng.random() < 0.3:
            n = rng.choice([1, 1, 2])
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(100) for _ in range(rng.randrange(1, 14))]
            sched.add(Sequence(f"r{step}", prompt, SamplingParams(n=n, max_tokens=20), max_tokens=rng.randrange(1, 12)))
        if rng.random() < 0.05 and sched.running:  # abort
            sched.finish(rng.choice(sched.running))
        batch = sched.schedule()
        if not batch.seqs:
            continue
        msg = enc.encode(batch)
        copies += len(msg.copies)
        rank_batch = mirror.apply(msg)
        assert rank_batch.num_new_tokens == batch.num_new_tokens and rank_batch.copies == batch.copies
        for seq, n, view in zip(batch.seqs, batch.num_new_tokens, rank_batch.seqs):
            start = seq.num_computed_tokens
            assert view.block_table == seq.block_table
            assert view.token_ids[start:start + n] == seq.token_ids[start:start + n]
            assert (view.num_tokens, view.num_computed_tokens) == (seq.num_tokens, start)
        assert mirror.tables == enc.sent
        # The engine's own post-step path: advance, fork finished prefills, append, finish.
        sched.update_from_output(batch, batch.sampled(bm.block_size),
                                 lambda rows, seqs: [rng.randrange(100) for _ in seqs], _append_token)
        sched.check_integrity()
    assert sched.stats.num_preemptions > 0 and copies > 0 and sched.stats.prefix_hit_tokens > 0
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq)
    mirror.apply(enc.encode(ScheduledBatch()))
    assert mirror.tables == {} and enc.sent == {}


def test_decode_message_is_small():
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(SchedulerConfig(8, 256), bm)
    seqs = [Sequence(str(i), list(range(3, 3 + 200)), SamplingParams(), max_tokens=50) for i in range(4)]
    for s in seqs:
        sched.add(s)
    enc = StepEncoder()
    for _ in range(6):  # prefill in 256-token chunks, then decodes
        batch = sched.schedule()
        msg = enc.encode(batch)
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
    assert all(len(d.token_ids) == 1 and len(d.new_blocks) <= 1 for d in msg.seqs)  # no prompt, no whole table


# -- errors before anything starts --------------------------------------------------------------

@pytest.mark.parametrize("kind,tp", [("tied", 2), ("gqa", 3)])
def test_cannot_split_tiny_is_clear_and_early(tmp_path, smollm2_path, kind, tp):
    d = make_tiny_llama(tmp_path / kind, smollm2_path, kind)
    with pytest.raises(ValueError, match=f"cannot split this model across tensor_parallel_size={tp}"):
        LLM(model=str(d), tensor_parallel_size=tp)


def test_smollm2_tp2_cannot_split(smollm2_path):
    import ray

    started = ray.is_initialized()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: num_attention_heads=9, num_key_value_heads=3"):
        LLM(model=smollm2_path, tensor_parallel_size=2)
    assert ray.is_initialized() == started  # refused before Ray, actors or weights


# -- on Ray --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():  # someone else's instance: use it, leave it up
        yield ray
        return
    # Logical CPUs: a module-scoped group may still be up while another test builds its own.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TINY_CONFIGS, "mqa", MQA)
        return {"gqa": make_tiny_llama(tmp_path_factory.mktemp("gqa"), smollm2_path, "gqa", vocab_size=509),
                "mqa": make_tiny_llama(tmp_path_factory.mktemp("mqa"), smollm2_path, "mqa", vocab_size=509)}


ENGINE = dict(num_gpu_blocks_override=12, max_num_batched_tokens=24)  # chunked prefill + preemption


@pytest.fixture(scope="module", params=["gqa", "mqa"])
def tp2(request, ray_cluster, tiny_dirs):
    d = tiny_dirs[request.param]
    prompts = _prompts()
    ref = hf_greedy(d, prompts, MAX_NEW)
    tp1 = _tokens(LLM(model=str(d), **ENGINE).generate(prompts, GREEDY))
    llm = LLM(model=str(d), tensor_parallel_size=2, **ENGINE)
    yield d, llm, prompts, ref, tp1
    llm.engine.executor.shutdown()


def test_tp2_exact_under_preemption(tp2):
    _, llm, prompts, ref, tp1 = tp2
    preempted = llm.engine.stats().num_preemptions
    assert _tokens(llm.generate(prompts, GREEDY)) == ref == tp1
    assert llm.engine.stats().num_preemptions > preempted
    _assert_clean(llm)


def test_tp2_exact_staggered_arrivals(tp2):
    _, llm, prompts, ref, _ = tp2
    eng, done = llm.engine, {}
    for i, p in enumerate(prompts):  # each arrives while the others are mid-flight
        eng.add_request(f"s{i}", p, GREEDY)
        for _ in range(3):
            done.update({o.request_id: o for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[f"s{i}"].outputs[0].token_ids for i in range(len(prompts))] == ref
    _assert_clean(llm)


SAMPLED = [  # seeds, forks, penalties, filters, min_tokens against eos, stop ids, logprobs, the engine's seed
    SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=1.1, top_k=20, seed=3, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.3, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=1.5, seed=5, min_tokens=8, max_tokens=MAX_NEW, logprobs=3),
    SamplingParams(n=3, temperature=1.0, seed=7, min_p=0.05, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=MAX_NEW, stop_token_ids=[100, 200, 300], ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(n=2, temperature=0.7, top_k=5, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=9, max_tokens=MAX_NEW, ignore_eos=True, bad_words=["a", "the", "xyz"]),
    SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=MAX_NEW, ignore_eos=True,
                   allowed_token_ids=list(range(3, 60))),
]


def _samples(outs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_tp2_sampling_on_the_sampling_rank_matches_tp1(tp2):
    """Rank 0 samples: the same tokens as tp=1 for seeded and unseeded rows, forks, penalties,
    min_tokens, stop ids, bad words and allowed tokens, through chunked prefill and preemption;
    logprobs as asked."""
    d, llm, prompts, _, _ = tp2
    prompts = (prompts * 2)[:len(SAMPLED)]
    want = LLM(model=str(d), **ENGINE).generate(prompts, SAMPLED)
    got = llm.generate(prompts, SAMPLED)
    assert _samples(got) == _samples(want)
    assert len({tuple(c.token_ids) for c in got[3].outputs}) > 1  # forks drew apart
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            for ge, we in zip(gc.logprobs or [], wc.logprobs or []):
                assert ge.keys() == we.keys()
                assert {t: e.logprob for t, e in ge.items()} == pytest.approx({t: e.logprob for t, e in we.items()}, abs=1e-4)
                assert all(isinstance(e.rank, int) and e.rank >= 1 for e in ge.values())  # the sampling rank's ranks
    assert [len(e) for e in got[2].outputs[0].logprobs] == [len(e) for e in want[2].outputs[0].logprobs]
    assert all(3 <= t < 60 for c in got[8].outputs for t in c.token_ids)
    _assert_clean(llm)
    # the next step's message drops the records of every sequence that finished
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    import ray

    records = ray.get(llm.engine.executor.group.ranks[0].sampling_records.remote())
    assert len(records) <= 1 and all(isinstance(k, int) for k in records)


def test_tp2_speculative_decoding_matches_tp1(ray_cluster, tiny_dirs):
    """Drafts (engine.speculative) at tp=2: the ranks run them as decode rows, the sampling rank
    draws at each and its records keep what the engine keeps; greedy is HF-exact, and seeded
    samples, penalties and logprobs are tp=1's with drafts, through chunked prefill and preemption."""
    from tests.test_speculative import NGRAM, repeating_prompts

    d = tiny_dirs["gqa"]
    prompts = repeating_prompts(vocab=509)
    params = [GREEDY, SAMPLED[0], SAMPLED[1], SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2,
                                                             ignore_eos=True), SAMPLED[2]]
    engine = {**ENGINE, "max_num_batched_tokens": 32}  # a budget that leaves room for drafts
    want = LLM(model=str(d), speculative_config=NGRAM, **engine).generate(prompts, params)
    llm = LLM(model=str(d), tensor_parallel_size=2, speculative_config=NGRAM, **engine)
    try:
        got = llm.generate(prompts, params)
        assert _samples(got) == _samples(want)
        assert got[0].outputs[0].token_ids == hf_greedy(d, prompts[:1], MAX_NEW)[0]
        for ge, we in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs):
            assert {t: e.logprob for t, e in ge.items()} == pytest.approx({t: e.logprob for t, e in we.items()}, abs=1e-4)
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens > 0 and stats.num_preemptions > 0
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_tp2_pooling_gives_tp1s_embeddings(ray_cluster, tiny_dirs, pooling_type):
    """A pooling engine at tp=2 (engine.pooling): the sampling rank takes the replicated hidden
    rows (MEAN: every prompt row's sum too) and only those numbers leave the group; through
    chunked prefill the vectors are tp=1's, each as asked (normalised or not)."""
    from engine import PoolingParams

    d = tiny_dirs["gqa"]
    prompts = _prompts()
    params = [PoolingParams(use_activation=i % 2 == 0) for i in range(len(prompts))]
    engine = dict(runner="pooling", pooler_config={"pooling_type": pooling_type}, **ENGINE)
    tp1 = LLM(model=str(d), **engine)
    want = tp1.embed(prompts, pooling_params=params, use_tqdm=False)
    # token_embed beside embed requests (MEAN's or LAST's): every row of those leaves the group
    tasks = [PoolingParams(task="token_embed" if i % 2 else "embed") for i in range(len(prompts))]
    want_tokens = tp1.encode(prompts, tasks, use_tqdm=False)
    llm = LLM(model=str(d), tensor_parallel_size=2, **engine)
    try:
        got = llm.embed(prompts, pooling_params=params, use_tqdm=False)
        for g, w in zip(got, want):
            assert g.outputs.embedding == pytest.approx(w.outputs.embedding, abs=1e-5)
        for g, w in zip(llm.encode(prompts, tasks, use_tqdm=False), want_tokens):
            assert g.outputs.data.shape == w.outputs.data.shape and torch.allclose(g.outputs.data, w.outputs.data,
                                                                                   atol=1e-5, rtol=0)
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


def test_tp2_a_classifier_gives_tp1s_probabilities(ray_cluster, tiny_dirs, tmp_path):
    """A sequence classifier at tp=2 (engine.classifier): every rank holds the whole `score`
    head after the all-reduced final norm, and the sampling rank's logits give tp=1's probabilities."""
    d = make_tiny_classifier(tiny_dirs["gqa"], tmp_path / "classifier", 3)
    prompts = _prompts()
    want = LLM(model=str(d), **ENGINE).classify(prompts, use_tqdm=False)
    llm = LLM(model=str(d), tensor_parallel_size=2, **ENGINE)
    try:
        got = llm.classify(prompts, use_tqdm=False)
        for g, w in zip(got, want):
            assert g.outputs.probs == pytest.approx(w.outputs.probs, abs=1e-5)
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


def test_tp2_a_step_that_raised_in_an_append_leaves_no_record_a_token_ahead(tp2, monkeypatch):
    """Ctrl-C in an append after the sampling rank drew: the record of the sequence the append
    never reached is cut back to the engine's tokens (its penalties read them), so stepping on gives
    what an uninterrupted run gives, as at tp=1."""
    from tests.test_llm_interrupted import step_interrupted_in_second_append

    d, llm, prompts, _, _ = tp2
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0)
    want = [o.outputs[0].token_ids for o in LLM(model=str(d), **ENGINE).generate(prompts[:2], params)]
    eng, done = llm.engine, {}
    eng.add_request("r0", prompts[0], params)
    eng.add_request("r1", prompts[1], params)
    while min(eng.requests[r].seqs[0].num_output_tokens for r in ("r0", "r1")) < 2:  # both decoding
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    step_interrupted_in_second_append(eng, monkeypatch)  # r0's token kept, r1's drawn but not appended
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[r].outputs[0].token_ids for r in ("r0", "r1")] == want
    _assert_clean(llm)


def test_tp2_forks_copy_on_write(tp2):
    _, llm, prompts, ref, _ = tp2
    encoder, copies = llm.engine.executor.encoder, []
    encode = encoder.encode

    def spy(batch):
        msg = encode(batch)
        copies.extend(msg.copies)
        return msg
    encoder.encode = spy
    try:
        outs = llm.generate(prompts[:4], SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    finally:
        encoder.encode = encode
    for out, r in zip(outs, ref[:4]):
        assert [c.token_ids for c in out.outputs] == [r, r]
    assert copies, "forked sequences writing a shared partial block must copy it on every rank"
    _assert_clean(llm)
    # every rank dropped the mirrors of finished sequences once the next step said so
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    import ray

    for tables in ray.get([a.mirror_tables.remote() for a in llm.engine.executor.group.ranks]):
        assert len(tables) <= 1


def _audited_rank_cls():
    from workers.rank import RankWorker

    class _Audited(RankWorker):  # records every safetensors file it opens, whatever the code path
        def __init__(self, *args) -> None:
            super().__init__(*args)
            import safetensors

            self.opened = []
            real = safetensors.safe_open

            def spy(path, *a, **k):
                self.opened.append(str(path))
                return real(path, *a, **k)
            safetensors.safe_open = spy

        def audit(self) -> list[str]:
            return self.opened
    return _Audited


@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_tp2_lora_adapters_are_peft_exact(ray_cluster, tiny_dirs, tmp_path, kind):
    """Each rank holds its shard of every adapter (B's rows of q/k/v and gate/up, A's columns of
    o and down; a replicated KV head's whole), under chunked prefill and preemption; an adapter
    that does not fit is the request's error, and the group serves on."""
    from engine import LoRARequest
    from engine.errors import InvalidRequestError
    from tests.tiny_lora import make_adapter, peft_greedy

    d, prompts = tiny_dirs[kind], _prompts()[:5]
    loras = [LoRARequest(f"a{i}", i, make_adapter(d, tmp_path / f"a{i}", r=4 * i, seed=i)) for i in (1, 2)]
    names = [None, loras[0], loras[1], loras[0], None]
    expected = {lora: peft_greedy(d, lora and lora.lora_path, prompts, MAX_NEW) for lora in [None, *loras]}
    llm = LLM(model=str(d), tensor_parallel_size=2, enable_lora=True, max_loras=2, **ENGINE)
    try:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=names)) == [expected[n][i] for i, n in enumerate(names)]
        assert llm.engine.stats().num_preemptions > 0
        with pytest.raises(InvalidRequestError, match="its rank 32 is more than --max-lora-rank 16"):
            llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("big", 3, make_adapter(d, tmp_path / "big", r=32)))
        assert _tokens(llm.generate(prompts[:1], GREEDY, lora_request=loras[1])) == expected[loras[1]][:1]
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_tp2_a_quantized_checkpoint_is_exact(ray_cluster, tiny_dirs, tmp_path, method):
    """A GPTQ, AWQ or compressed-tensors checkpoint at tp=2 (engine.model.quantized): rank 0 dequantizes each packed
    weight and scatters its pieces; each rank's decode reads its piece as 4-bit codes."""
    from benchmarks.quantize import quantize_checkpoint

    packed, ref = tmp_path / "packed", tmp_path / "reference"
    quantize_checkpoint(tiny_dirs["gqa"], packed, ref, method)
    prompts = _prompts()[:4]
    llm = LLM(model=str(packed), tensor_parallel_size=2, **ENGINE)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy(ref, prompts, MAX_NEW)
        assert [r["weight_codes"] for r in llm.engine.executor.stats()["ranks"]] == [8, 8]
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


def test_tp2_dummy_weights_read_no_file(ray_cluster, tiny_dirs, tmp_path):
    """--load-format dummy at tp=2: each rank fills its own shard, and no rank opens a file."""
    import shutil

    d = shutil.copytree(tiny_dirs["gqa"], tmp_path / "config-only", ignore=shutil.ignore_patterns("*.safetensors"))
    llm = LLM(model=str(d), tensor_parallel_size=2, load_format="dummy", **ENGINE)
    try:
        assert [len(t) for t in _tokens(llm.generate(_prompts()[:2], GREEDY))] == [MAX_NEW, MAX_NEW]
        stats = llm.engine.executor.stats()["ranks"]
        assert [(s["bytes_read"], s["bytes_received"], s["files_opened"]) for s in stats] == [(0, 0, [])] * 2
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()


def test_only_rank0_reads_weights_and_each_rank_holds_its_slice(ray_cluster, tiny_dirs):
    import torch

    from engine.config import EngineConfig
    from engine.model.layers import TPContext
    from engine.model.llama import LlamaModel
    from engine.model.loader import load_arch, load_weights
    from workers.executor import WorkerGroupExecutor

    d = tiny_dirs["gqa"]
    ex = WorkerGroupExecutor(EngineConfig(model=str(d), tensor_parallel_size=2, num_gpu_blocks_override=8),
                             worker_cls=_audited_rank_cls())
    try:
        ranks = ex.group.ranks
        assert ray_cluster.get([a.audit.remote() for a in ranks]) == [[str(d / "model.safetensors")], []]
        stats = ex.stats()["ranks"]
        arch, _ = load_arch(d)
        file_bytes = sum(p.numel() * 4 for p in LlamaModel(arch, torch.float32).parameters())
        assert [s["bytes_read"] for s in stats] == [file_bytes, 0]
        assert stats[1]["bytes_received"] == stats[1]["param_bytes"] < file_bytes
        for r, got in enumerate(ray_cluster.get([a.parameters.remote() for a in ranks])):
            want = LlamaModel(arch, torch.float32, TPContext(r, 2))  # the layers' own weight_loaders
            load_weights(want, d)
            assert got.keys() == dict(want.named_parameters()).keys()
            for name, p in want.named_parameters():
                assert torch.equal(got[name], p), f"rank {r} {name}"
    finally:
        ex.shutdown()
    assert not ex.healthy


@pytest.fixture(scope="module")
def smol_prompts(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    qs = ["What is the capital of France?", "List three prime numbers.", "Write a haiku about the sea."]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in qs]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_smollm2_tp3_exact_vs_tp1(ray_cluster, smollm2_path, smol_prompts):
    from transformers import AutoTokenizer

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _tokens(LLM(model=smollm2_path, num_gpu_blocks_override=64).generate(smol_prompts, params))
    llm = LLM(model=smollm2_path, tensor_parallel_size=3, num_gpu_blocks_override=64)
    try:
        eng, done = llm.engine, {}
        for i, p in enumerate(smol_prompts):  # staggered
            eng.add_request(str(i), p, params)
            done.update({o.request_id: o for o in eng.step() if o.finished})
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        assert [done[str(i)].outputs[0].token_ids for i in range(len(smol_prompts))] == ref
        assert "Paris" in AutoTokenizer.from_pretrained(smollm2_path).decode(ref[0])
        reports = llm.engine.executor.stats()["ranks"]
        assert [bool(r["files_opened"]) for r in reports] == [True, False, False]
        # Each rank's slices of the Q4_1 / Q8_0 weights are still whole 32-weight blocks: all codes.
        assert [r["weight_codes"] for r in reports] == [30 * 4 + 1] * 3
    finally:
        llm.engine.executor.shutdown()


# -- failures: never hang, clear messages, rebuild ---------------------------------------------

def test_killed_rank_fails_inflight_requests_then_rebuilt_group_serves(ray_cluster, tiny_dirs):
    from engine.async_engine import EngineDeadError

    d = tiny_dirs["gqa"]
    prompts = _prompts(seed=5, lens=(12, 30, 7))
    ref = hf_greedy(d, prompts[:1], MAX_NEW)
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def main():
        engine = AsyncEngine(model=str(d), tensor_parallel_size=2, num_gpu_blocks_override=256)
        try:
            outs = [o async for o in engine.generate("ok", prompts[0], GREEDY)]
            assert outs[-1].outputs[0].token_ids == ref[0]
            group = engine.engine.executor.group
            pids, pg_id = group.pids(), group.pg.id.hex()
            started = asyncio.Event()

            async def run(rid, prompt):
                async for _ in engine.generate(rid, prompt, long):
                    started.set()
            tasks = [asyncio.create_task(run(f"r{i}", p)) for i, p in enumerate(prompts)]
            await asyncio.wait_for(started.wait(), 30)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            assert time.monotonic() - t0 < 15
            assert all(isinstance(r, EngineDeadError) and "rank 1 died" in str(r) for r in results), results
            assert not engine.engine.executor.healthy
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("late", prompts[0], GREEDY):
                    pass
        finally:
            await engine.shutdown()
        return pg_id
    pg_id = asyncio.run(main())
    from ray.util import placement_group_table

    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    llm = LLM(model=str(d), tensor_parallel_size=2, num_gpu_blocks_override=64)  # rebuilt
    try:
        assert _tokens(llm.generate(prompts[:1], GREEDY)) == ref
    finally:
        llm.engine.executor.shutdown()


def _faulty_rank_cls():
    from workers.rank import RankWorker

    class _Faulty(RankWorker):
        def execute(self, msg):
            if self.rank == 1 and msg.step == 2:
                time.sleep(8)  # a long step: pings are still answered meanwhile
            if self.rank == 1 and msg.step == 3:
                raise RuntimeError("injected fault")
            return super().execute(msg)
    return _Faulty


def test_health_during_long_step_then_rank_that_raises_marks_group_unhealthy(ray_cluster, tiny_dirs):
    from concurrent.futures import ThreadPoolExecutor

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from workers.executor import WorkerGroupError, WorkerGroupExecutor
    from workers.group import WorkerGroupConfig

    config = EngineConfig(model=str(tiny_dirs["gqa"]), tensor_parallel_size=2, num_gpu_blocks_override=32)
    ex = WorkerGroupExecutor(config, WorkerGroupConfig(health_timeout_s=5), worker_cls=_faulty_rank_cls())
    engine = LLMEngine(config, executor=ex)
    engine.add_request("a", _prompts(lens=(20,))[0], GREEDY)
    engine.step()
    with ThreadPoolExecutor(1) as pool:
        health = pool.submit(lambda: (time.sleep(1), ex.check_health()))
        engine.step()  # 8 s on rank 1: the ping, a second in, is answered within 5 s
        health.result()
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match="rank 1 failed to run step 3: RuntimeError: injected fault"):
        engine.step()
    assert time.monotonic() - t0 < 20 and not ex.healthy
    with pytest.raises(WorkerGroupError, match="unhealthy"):
        engine.step()
    with pytest.raises(WorkerGroupError, match="unhealthy"):
        ex.check_health()
    ex.shutdown()


def _late_rank_cls():
    from workers.rank import RankWorker

    class _Late(RankWorker):
        def connect(self, port, timeout_s):
            if self.rank == 1:
                time.sleep(60)
            return super().connect(port, timeout_s)
    return _Late


def _mismatched_rank_cls():
    import dataclasses

    from workers.rank import RankWorker

    class _Mismatched(RankWorker):
        def _load_arch(self):
            arch = super()._load_arch()
            return dataclasses.replace(arch, rms_norm_eps=arch.rms_norm_eps * 2) if self.rank == 1 else arch
    return _Mismatched


@pytest.mark.parametrize("cls,match,join_timeout_s", [
    (_late_rank_cls, r"rank 1 did not join the group within 3s", 3),
    (_mismatched_rank_cls, r"rank \d failed to load the model: ValueError: rank 1 loaded a different model "
                           r"config or dtype than rank 0", 60),  # joining in time, however loaded the host
], ids=["join-timeout", "config-mismatch"])
def test_startup_failures_are_clear_and_release_everything(ray_cluster, tiny_dirs, cls, match, join_timeout_s):
    from ray.util import placement_group_table

    from engine.config import EngineConfig
    from workers.executor import WorkerGroupError, WorkerGroupExecutor
    from workers.group import WorkerGroupConfig

    def live_groups():
        return {k for k, pg in placement_group_table().items() if pg["state"] != "REMOVED"}

    config = EngineConfig(model=str(tiny_dirs["gqa"]), tensor_parallel_size=2, num_gpu_blocks_override=8)
    before, t0 = live_groups(), time.monotonic()
    with pytest.raises(WorkerGroupError, match=match):
        WorkerGroupExecutor(config, WorkerGroupConfig(join_timeout_s=join_timeout_s), worker_cls=cls())
    assert time.monotonic() - t0 < 40
    assert live_groups() == before


@pytest.mark.parametrize("ray_ids, visible, index", [
    ([], None, 0),  # no GPU assigned (CPU ranks)
    (["3"], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to this rank's GPU: torch's cuda:0
    ([3], "0,1,2,3", 3),  # several visible: the assigned one's position
    (["3"], None, 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU visible, by Ray's id
    (["5"], "GPU-0a1b2c", 0),  # ids Ray does not list (UUIDs): the first visible
])
def test_each_rank_finds_its_own_gpu(ray_ids, visible, index):
    from workers.rank import local_gpu_index

    assert local_gpu_index(ray_ids, visible) == index


def test_a_replicas_bundles_decide_whether_its_ranks_use_gpus():
    """A Serve deployment reserved the ranks' bundles when it was built; its ranks ask for what
    those hold, whatever the cluster shows when the replica starts (GPU nodes scaled to zero then)."""
    from cluster.app import engine_bundles, use_gpu
    from engine.config import EngineConfig
    from workers.group import WorkerGroupConfig, _wants_gpu

    for device in ("auto", "cuda"):
        config = EngineConfig(device=device, tensor_parallel_size=2)
        assert _wants_gpu(config, WorkerGroupConfig(), 2, engine_bundles(2, use_gpu=True))
        assert not _wants_gpu(config, WorkerGroupConfig(), 2, engine_bundles(2, use_gpu=False))
    assert use_gpu(EngineConfig(device="cuda:0")) and use_gpu(EngineConfig(device="cuda"))
    assert not use_gpu(EngineConfig(device="cpu"))


def test_a_step_that_samples_nothing_gathers_no_logits(monkeypatch):
    """Zero logit rows (a step of unfinished prefill chunks only): no rank calls the collective,
    a shape NCCL has never run here, and the sampling rank still gets its (0, vocab) logits."""
    import torch
    import torch.distributed as dist

    from engine.model.layers import TPContext

    def refuse(*args, **kwargs):
        raise AssertionError("gathered zero rows")

    monkeypatch.setattr(dist, "gather", refuse)
    rows = torch.empty(0, 7)
    assert TPContext(0, 2, object()).gather_last_dim(rows).shape == (0, 14)
    assert TPContext(1, 2, object()).gather_last_dim(rows) is None
    with pytest.raises(AssertionError, match="gathered zero rows"):
        TPContext(0, 2, object()).gather_last_dim(torch.empty(1, 7))


def test_a_rank_measures_its_step_before_sizing_its_pool(tiny_dirs, monkeypatch):
    """A tensor-parallel rank sizes its pool as tp=1 does, from a measured step (without graphs,
    which ranks do not capture), where it kept a fixed 5% of the GPU back before. One rank on a
    gloo group of one, the measurement stubbed: CPU ranks have no step to measure."""
    import torch.distributed as dist

    from engine.config import EngineConfig
    from workers import rank as rank_module

    measured, sized = [], []
    monkeypatch.setattr(rank_module, "step_bytes",
                        lambda model, config, max_model_len, kv_heads, device, graphs: measured.append(graphs) or 1)
    monkeypatch.setattr(rank_module, "num_kv_blocks", lambda config, block_bytes, device, step: sized.append(step) or 8)
    worker = rank_module.RankWorker(0, 1, EngineConfig(), str(tiny_dirs["gqa"]), "cpu", [2])
    worker.open_store(30)
    worker.init_collective(30)
    try:
        assert worker.load()["max_blocks"] == 8
    finally:
        dist.destroy_process_group()
    assert measured == [False] and sized == [1]


def test_a_config_that_does_not_match_its_weights_fails_every_rank_naming_the_tensor(ray_cluster, tiny_dirs,
                                                                                     tmp_path):
    import json
    import shutil

    from engine.config import EngineConfig
    from workers.executor import WorkerGroupError, WorkerGroupExecutor

    d = shutil.copytree(tiny_dirs["gqa"], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(WorkerGroupError, match=r"checkpoint tensor 'model.layers.0.mlp.down_proj.weight' has shape "
                                               r"\(64, 128\), but the model's config.json makes it \(64, 96\)"):
        WorkerGroupExecutor(EngineConfig(model=str(d), tensor_parallel_size=2, num_gpu_blocks_override=8))
