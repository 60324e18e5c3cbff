"""The CUDA path's model runner (engine.triton_runner: Triton attention, step inputs in flat
buffers) wired into the engine gives the logits of the torch path on every step: each step runs
both runners on their own KV pools and compares. Tiny random Llamas; on a CPU-only host the kernels
run under Triton's interpreter (tests/triton_interp.py)."""
from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache import allocate_kv_cache
from engine.model.loader import build_model
from engine.model_runner import ModelRunner, RunnerOutput
from tests.test_engine_exact import _assert_clean, _prompts
from tests.tiny_llama import make_tiny_llama
from tests.triton_interp import kernels_here


@pytest.fixture(scope="module", autouse=True)
def device():
    with kernels_here() as d:
        yield d


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """kind -> model dir: "gqa" (4 heads / 2 KV), "tied" (6 / 3, tied embeddings, llama3 rope), "qwen3"
    (q/k norms, head_dim 32). The
    tokenizer comes from $KVSERVE_TEST_TOKENIZER_DIR where set (a GPU host without the embedded
    model), else from the embedded SmolLM2."""
    tokenizer_dir = os.environ.get("KVSERVE_TEST_TOKENIZER_DIR") or request.getfixturevalue("smollm2_path")
    return {kind: make_tiny_llama(tmp_path_factory.mktemp(kind), tokenizer_dir, kind) for kind in ("gqa", "tied", "qwen3")}


class Twin:
    """Runs every step on the torch runner and the Triton runner; their logits must agree."""

    def __init__(self, ref: ModelRunner, other: ModelRunner) -> None:
        self.ref, self.other, self.steps, self.mixed = ref, other, 0, 0

    def execute(self, batch) -> RunnerOutput:
        a, b = self.ref.execute(batch), self.other.execute(batch)
        assert a.sampled == b.sampled and a.prompt_spans == b.prompt_spans
        assert (a.logits is None) == (b.logits is None) and (a.pooled is None) == (b.pooled is None)
        if a.pooled is not None:  # a pooling model's rows (engine.pooling), where logits would be
            torch.testing.assert_close(b.pooled.cpu(), a.pooled, rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(b.logits.cpu(), a.logits, rtol=1e-4, atol=1e-4)
        if a.prompt_rows is not None and a.pooled is not None:  # a mean-pooling request's rows themselves
            torch.testing.assert_close(b.prompt_rows.hidden.cpu(), a.prompt_rows.hidden, rtol=1e-4, atol=1e-4)
        elif a.prompt_rows is not None:
            torch.testing.assert_close(torch.cat(list(b.prompt_rows.logits())).cpu(),
                                       torch.cat(list(a.prompt_rows.logits())), rtol=1e-4, atol=1e-4)
        self.steps += 1
        self.mixed += 1 < max(batch.num_new_tokens) and 1 == min(batch.num_new_tokens)  # a launch each
        return a


def _twin_llm(model_dir, device, **kw) -> tuple[LLM, Twin]:
    from engine.runners import triton_runner

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", **kw)
    ex, config = llm.engine.executor, llm.engine.config
    ref = ex.runner
    k = ref.kv_caches[0][0]
    kv = allocate_kv_cache(len(ref.kv_caches), k.shape[0], k.shape[1], k.shape[2], k.shape[3], k.dtype, device)
    # On a GPU the same checkpoint loaded there (a copy of the CPU model would carry its oneDNN-packed weights)
    model = ex.model if device.type == "cpu" else build_model(model_dir, torch.float32, device)
    other = triton_runner(model, kv, config, ex.info.max_position_embeddings, device)
    ex.runner = Twin(ref, other)
    return llm, ex.runner


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("kind, engine_kwargs", [
    ("gqa", dict(num_gpu_blocks_override=64)),
    ("tied", dict(num_gpu_blocks_override=64)),
    ("qwen3", dict(num_gpu_blocks_override=64)),
    ("gqa", dict(num_gpu_blocks_override=64, max_num_batched_tokens=24, block_size=4)),  # chunks, small blocks
], ids=["gqa", "tied", "qwen3", "gqa-chunked-bs4"])
def test_triton_runner_logits_match_torch_runner(tiny, device, kind, engine_kwargs):
    llm, twin = _twin_llm(tiny[kind], device, **engine_kwargs)
    prompts = _prompts(lens=(5, 17, 33, 40))
    llm.generate(prompts, GREEDY)
    llm.generate(prompts[:2] + [prompts[2][:20] + [7, 8, 9]], GREEDY)  # prefix-cache hits
    assert llm.engine.stats().prefix_hit_tokens > 0
    assert twin.steps > 10
    assert twin.mixed > 0 or "max_num_batched_tokens" not in engine_kwargs  # chunks beside decodes
    _assert_clean(llm)


def test_lora_adapters_match_torch_runner(tiny, device, tmp_path):
    """Adapted rows beside base-model rows, in prefill chunks and decodes: the Triton runner adds
    the same deltas (engine.lora), and its decode graphs step aside for them."""
    from engine import LoRARequest
    from engine.lora import attach, load_adapter
    from tests.tiny_lora import make_adapter

    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_batched_tokens=24, block_size=4,
                          enable_lora=True, max_loras=2)
    loras = [LoRARequest(f"a{i}", i, make_adapter(tiny["gqa"], tmp_path / f"a{i}", seed=i)) for i in (1, 2)]
    if device.type != "cpu":  # the Triton runner's own model, on the device: its own copy of the adapters
        attach(twin.other.model, type(llm.engine.executor.model.lora)())
        for lora in loras:
            twin.other.model.lora.adapters[lora.lora_int_id] = load_adapter(lora, twin.other.model)
    prompts = _prompts(lens=(5, 17, 33, 40))
    outs = llm.generate(prompts, GREEDY, lora_request=[None, loras[0], loras[1], loras[0]])
    assert twin.steps >= 8 and twin.mixed > 0
    base = llm.generate(prompts[1:3], GREEDY)  # the adapters changed what the model says
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in outs[1:3]]
    _assert_clean(llm)


def test_speculative_drafts_match_torch_runner(tiny, device):
    """Decodes with drafts (engine.speculative): a decode row per draft, each seeing one more
    token, beside prefill chunks and plain decodes; the logits of every draft row agree."""
    from tests.test_speculative import NGRAM, PROMPTS

    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_batched_tokens=24, block_size=4,
                          speculative_config=NGRAM)
    llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    st = llm.engine.scheduler.stats
    assert twin.steps >= 5 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    _assert_clean(llm)


def test_preemption_and_recompute(tiny, device):
    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=14, max_num_batched_tokens=16, block_size=4)
    llm.generate(_prompts(lens=(5, 17, 33, 40)), GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)


def test_prompt_logprob_rows_match(tiny, device):
    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(_prompts(lens=(9, 30)), params)
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    _assert_clean(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pooled_rows_match(tiny, device, pooling_type):
    """A pooling engine (engine.pooling) on the Triton runner: the rows it pools (MEAN: every
    prompt row, as prompt logprobs take theirs) are the torch runner's, through chunked prefill and
    a repeated prompt (LAST: a prefix-cache hit)."""
    llm, twin = _twin_llm(tiny["qwen3"], device, runner="pooling", num_gpu_blocks_override=64,
                          max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type})
    prompts = _prompts(lens=(9, 30, 3))
    outs = llm.embed(prompts + prompts[1:2], use_tqdm=False)
    assert (outs[3].num_cached_tokens > 0) == (pooling_type == "LAST")
    assert outs[3].outputs.embedding == pytest.approx(outs[1].outputs.embedding, abs=1e-6)
    tokens = llm.encode(prompts[:2], pooling_task="token_embed", use_tqdm=False)  # every row, step by step
    assert [len(t.outputs.data) for t in tokens] == [9, 30]
    assert twin.steps >= 3
    _assert_clean(llm)


class EagerGraphs:
    """Stands in for engine.cuda_graphs.DecodeGraphs on CPU: 'replays' the captured body itself (the
    model on the static buffers, laid out for the bucket size), so the padding to a bucket, the
    padding rows and the fixed layout are checked without a GPU."""

    def __init__(self, runner, sizes: list[int]) -> None:
        self.runner, self.sizes, self.replays = runner, sizes, 0

    def size_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def replay(self, size: int) -> torch.Tensor:
        self.replays += 1
        return self.runner._forward(self.runner._decode_layout(size))


def test_a_capture_cuda_refuses_leaves_the_engine_eager(tiny, device, monkeypatch, caplog):
    from engine import triton_runner

    def refused(*_):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    _, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_seqs=4)
    monkeypatch.setattr(triton_runner, "DecodeGraphs", refused)
    assert twin.other.graph_sizes and twin.other.capture_graphs() == [] and twin.other.graphs is None
    assert "CUDA graph capture failed, so decode steps run eagerly" in caplog.text and "not permitted" in caplog.text


def test_decode_steps_padded_to_graph_buckets(tiny, device):
    from engine.cuda_graphs import graph_batch_sizes

    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_seqs=6)
    twin.other.graphs = EagerGraphs(twin.other, graph_batch_sizes(6))  # 1, 2, 4, 6
    lengths = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 3, 5, 6, 8)]
    llm.generate(_prompts(lens=(5, 17, 33, 40, 9)), lengths)  # 5 decodes pad to 6, then 4 to 4, 3 to 4, ...
    assert twin.other.graphs.replays > 3
    _assert_clean(llm)


def test_decode_steps_with_drafts_replay_graphs(tiny, device):
    """A decode step whose sequences have drafts is decode rows only: it replays the graph of its
    rows' bucket (padding rows included), with the torch runner's logits; one with more rows than
    the largest bucket runs eagerly. vLLM's max_cudagraph_capture_size takes the buckets past
    max_num_seqs, to the rows of steps with drafts."""
    from tests.test_speculative import NGRAM, PROMPTS

    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, max_num_seqs=6, block_size=4,
                          speculative_config=NGRAM, max_cudagraph_capture_size=16)
    assert twin.other.graph_sizes == [1, 2, 4, 8, 16]
    twin.other.graphs = EagerGraphs(twin.other, twin.other.graph_sizes)
    replayed = []
    graph_size = twin.other._graph_size

    def recording(batch):
        size = graph_size(batch)
        if size is not None and any(s.spec_token_ids for s in batch.seqs):
            replayed.append((batch.num_tokens, size))
        return size

    twin.other._graph_size = recording
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    st = llm.engine.scheduler.stats
    assert replayed and all(n <= size for n, size in replayed) and 0 < st.spec_accepted_tokens
    assert max(n for n, _ in replayed) > 6  # more rows than sequences, in a bucket past max_num_seqs
    _assert_clean(llm)


def test_split_kv_decode_steps(tiny, device, monkeypatch):
    """Decode steps with each program's context split in three (what a GPU does at small batches)
    give the torch runner's logits, in graph buckets with padding sequences too."""
    from engine.cuda_graphs import graph_batch_sizes
    from engine.kernels import paged_attention

    calls = []
    monkeypatch.setattr(paged_attention, "decode_splits", lambda num_seqs, kvh, dev: calls.append(num_seqs) or 3)
    llm, twin = _twin_llm(tiny["tied"], device, num_gpu_blocks_override=64, max_num_seqs=4, block_size=4)
    twin.other.graphs = EagerGraphs(twin.other, graph_batch_sizes(4))
    lengths = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 12)]
    llm.generate(_prompts(lens=(5, 17, 33)), lengths)
    assert twin.other.graphs.replays > 5 and len(calls) > 5
    _assert_clean(llm)


def test_forked_samples_copy_their_shared_block(tiny, device):
    """n > 1: the children share the parent's blocks, and the first write into the shared partial
    block copies it (copy-on-write) in the Triton runner's pool as in the torch runner's."""
    llm, twin = _twin_llm(tiny["gqa"], device, num_gpu_blocks_override=64, block_size=4)
    copies = []
    execute = twin.execute

    def counting(batch):
        copies.extend(batch.copies)
        return execute(batch)

    twin.execute = counting
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate(_prompts(lens=(10,)), params)  # 10 tokens: the third block is shared, partial
    assert len(out.outputs) == 3 and copies
    _assert_clean(llm)
