"""The engine on a CUDA GPU: greedy output token-exact against HF transformers `generate` on the
same GPU, weights and dtype, under the scheduling paths of test_engine_exact, with the Triton
attention backend, both with CUDA graphs for decode steps and with enforce_eager; in bfloat16,
a departure where HF's two best logits nearly tie passes (tests/tiny_llama.py's tie_breaks: two
bfloat16 implementations round differently, and HF bfloat16 already departs from HF float32 on
these models). Skipped where
there is no GPU (CI has none); run by hand on a GPU node (benchmarks/gpu_check.sh). The tiny models
take their tokenizer from $KVSERVE_TEST_TOKENIZER_DIR when set (a GPU node without the embedded
model's package), else from the embedded SmolLM2."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from engine import LLM
from tests.test_engine_exact import GREEDY, MAX_NEW, _assert_clean, _prompts, _run_staggered, _tokens
from tests.tiny_llama import hf_greedy, make_tiny_llama, tie_breaks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def tokenizer_dir(request):
    return os.environ.get("KVSERVE_TEST_TOKENIZER_DIR") or request.getfixturevalue("smollm2_path")


@pytest.fixture(scope="module", params=["gqa-float32", "tied-float32", "gqa-bfloat16", "qwen3-float32"])
def case(request, tmp_path_factory, tokenizer_dir):
    kind, dtype = request.param.split("-")
    d = make_tiny_llama(tmp_path_factory.mktemp(kind), tokenizer_dir, kind)
    prompts = _prompts()
    return d, dtype, prompts, hf_greedy(d, prompts, MAX_NEW, device="cuda", dtype=DTYPES[dtype])


@pytest.fixture(params=["graphs", "eager"])
def enforce_eager(request):
    return request.param == "eager"


def _llm(case, **kw) -> LLM:
    """max_num_seqs 8 unless given: the prompts still batch, and an engine captures 4 graphs, not 15
    (gpu_check.sh's window holds these tests some 60 times over)."""
    d, dtype, _, _ = case
    return LLM(model=str(d), device="cuda", dtype=dtype, **{"max_num_seqs": 8, **kw})


def _assert_greedy(case, got: list[list[int]]) -> None:
    d, dtype, prompts, expected = case
    if dtype == "float32":
        assert got == expected
    else:
        assert tie_breaks(d, prompts, got, expected, device="cuda", dtype=DTYPES[dtype]) == []


def _assert_backend(llm: LLM, enforce_eager: bool) -> None:
    from engine.triton_runner import TritonModelRunner

    runner = llm.engine.executor.runner
    assert isinstance(runner, TritonModelRunner)
    if enforce_eager:
        assert runner.graphs is None
    else:
        assert runner.graphs is not None and runner.graphs.replays > 0  # decode steps ran as graphs


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=128),
    dict(num_gpu_blocks_override=128, max_num_batched_tokens=7),  # chunked prefill
    dict(num_gpu_blocks_override=128, max_num_seqs=2),
    dict(num_gpu_blocks_override=128, block_size=4),
    dict(num_gpu_blocks_override=128, enable_prefix_caching=False),
    dict(num_gpu_blocks_override=12, max_num_batched_tokens=32),  # preemption (as test_engine_exact)
    dict(num_gpu_blocks_override=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1}),  # drafts: decode rows, graphs
], ids=["batch", "chunked", "max2seqs", "bs4", "nocache", "preempt", "ngram"])
def test_exact_on_cuda(case, engine_kwargs, enforce_eager):
    llm = _llm(case, enforce_eager=enforce_eager, **engine_kwargs)
    assert next(llm.engine.executor.model.parameters()).is_cuda
    _assert_greedy(case, _tokens(llm.generate(case[2], GREEDY)))
    _assert_backend(llm, enforce_eager)
    _assert_clean(llm)


def test_exact_on_cuda_staggered_and_prefix_hits(case, enforce_eager):
    llm = _llm(case, num_gpu_blocks_override=128, enforce_eager=enforce_eager)
    _assert_greedy(case, _run_staggered(llm, case[2], steps_between=3))
    _assert_greedy(case, _tokens(llm.generate(case[2], GREEDY)))  # second pass: prefix-cache hits
    assert llm.engine.stats().prefix_hit_tokens > 0
    _assert_backend(llm, enforce_eager)
    _assert_clean(llm)


def test_kv_pool_sized_after_measuring_steps_and_graphs(case):
    """No explicit pool size: the pool takes what --gpu-memory-utilization leaves after the
    measured step memory and graphs, and the engine still runs exactly."""
    free, total = torch.cuda.mem_get_info()
    # About 1 GiB beyond what is in use now: a share of a whole H200 would be millions of tiny blocks.
    utilization = min(1.0, (total - free + (1 << 30)) / total)
    llm = _llm(case, gpu_memory_utilization=utilization, max_num_seqs=16)
    assert llm.engine.stats().num_total_blocks > 1000
    _assert_greedy(case, _tokens(llm.generate(case[2], GREEDY)))
    _assert_clean(llm)


@pytest.mark.parametrize("nucleus", ["covered", "short"])
def test_sampling_waits_for_the_device_once(nucleus, monkeypatch):
    """A batch using every sampling feature, sampled on the GPU: the host waits for the device
    once, in the copy that brings back the ids and logprobs (torch's sync debug mode reports every
    wait). Rows short of their nucleus (flat logits, 1 candidate) cost a second round, and get
    the tokens a full sort would have given."""
    from engine import sampler as sampler_module
    from engine.sampler import Sampler
    from tests.test_sampler import mixed_rows

    flat = nucleus == "short"
    logits = torch.randn(len(mixed_rows()), 1000, generator=torch.Generator().manual_seed(0)) * (0.1 if flat else 4)
    logits = logits.cuda()
    if flat:
        full = [r.token_id for r in Sampler(1).sample(logits, mixed_rows("cuda"))]  # 1000 candidates: all covered
        monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 1)
    Sampler(1).sample(logits, mixed_rows("cuda"))  # first use: allocations, generators
    sampler, rows = Sampler(1), mixed_rows("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    if flat:
        assert [r.token_id for r in results] == full
        assert len(waits) > 1
    else:
        assert len(waits) == 1, [str(w.message) for w in waits]
        assert results[7].token_id == int(logits[7].argmax())


def test_the_engine_core_in_its_own_process_serves_on_cuda(tmp_path, tokenizer_dir):
    """ProcessEngine (the engine core in a process of its own, as vLLM's EngineCore; `--engine-cls
    engine.process_engine:ProcessEngine`) on CUDA: the child initializes the GPU itself, and the
    streams it relays carry the offline engine's greedy tokens. What a GPU default of it needs."""
    import asyncio

    from engine.process_engine import ProcessEngine

    d, prompts = make_tiny_llama(tmp_path, tokenizer_dir, "gqa"), _prompts()
    # A pool of its own size in each: sized from the GPU's free memory, the child would find the
    # parent's (cached by its allocator) taken, and no room left.
    ref = _tokens(LLM(model=str(d), device="cuda", max_num_seqs=8, num_gpu_blocks_override=128).generate(prompts,
                                                                                                        GREEDY))

    async def main():
        engine = ProcessEngine(model=str(d), device="cuda", max_num_seqs=8, num_gpu_blocks_override=128)

        async def stream(i: int, prompt: list[int]) -> list[int]:
            outs = [out async for out in engine.generate(str(i), prompt, GREEDY)]
            return [t for out in outs for t in out.outputs[0].delta_token_ids]

        try:
            return await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == ref


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_a_quantized_checkpoint_on_cuda_is_exact_on_its_float_weights(tmp_path, tokenizer_dir, method):
    """A GPTQ or compressed-tensors checkpoint (engine.model.quantized) on CUDA in float32, decode
    graphs captured: its weights dequantized at load, greedy output HF's on the float weights."""
    from benchmarks.quantize import quantize_checkpoint

    src, prompts = make_tiny_llama(tmp_path / "src", tokenizer_dir, "gqa"), _prompts()
    quantize_checkpoint(src, tmp_path / "packed", tmp_path / "float", method)
    llm = LLM(model=str(tmp_path / "packed"), device="cuda", dtype="float32", max_num_seqs=8,
              num_gpu_blocks_override=128)
    assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy(tmp_path / "float", prompts, MAX_NEW, device="cuda")
    _assert_clean(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "ALL"])
def test_embeddings_on_cuda_are_hfs_pooled_hidden_states(tmp_path, tokenizer_dir, pooling_type):
    """A pooling engine (engine.pooling, --runner pooling) on CUDA in float32, with the decode graphs
    captured: each prompt's vector is HF's base model's last hidden state (MEAN: the mean of all;
    ALL, the token_embed task: every token's), normalised, on the same GPU, through chunked prefill."""
    from transformers import AutoModel

    d, prompts = make_tiny_llama(tmp_path, tokenizer_dir, "qwen3"), _prompts()
    pooler = {"pooling_type": "LAST" if pooling_type == "ALL" else pooling_type}  # ALL is a task's, not a pooler's
    llm = LLM(model=str(d), device="cuda", dtype="float32", runner="pooling", max_num_seqs=8,  # a pool of its own size:
              max_num_batched_tokens=32, pooler_config=pooler, num_gpu_blocks_override=128)  # 0.9 of a GPU is millions
    if pooling_type == "ALL":
        got = [o.outputs.data.tolist() for o in llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)]
    else:
        got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    model = AutoModel.from_pretrained(str(d), dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        for p, g in zip(prompts, got):
            h = model(torch.tensor([p], device="cuda")).last_hidden_state[0]
            pooled = {"LAST": h[-1], "MEAN": h.mean(dim=0), "ALL": h}[pooling_type]
            want = torch.nn.functional.normalize(pooled, dim=-1).cpu()
            torch.testing.assert_close(torch.tensor(g), want, rtol=0, atol=1e-4)
    _assert_clean(llm)


@pytest.mark.parametrize("kind", ["bert", "distilbert", "nomic_bert", "modernbert", "gte"])
def test_an_encoder_on_cuda_embeds_and_scores_as_hf(tmp_path, kind):
    """An encoder (engine.model.bert's BERT, DistilBERT, NomicBERT and GTE,
    engine.model.modernbert; run by engine.encoder_runner) on CUDA in float32: its CLS vectors
    and a cross-encoder's scores are HF's (computed on the CPU), each step's prompts of many
    lengths (ModernBERT's local window of 8 crossed)."""
    from transformers import CONFIG_MAPPING

    from tests.tiny_bert import hf_encode, make_tiny_encoder

    if kind not in CONFIG_MAPPING:  # the GPU host's transformers may predate it: HF is the reference
        pytest.skip(f"this transformers has no {kind} to compare with")
    texts = ["the capital of france is paris", "what city", "a dog runs fast in the blue sky and the sea"]
    d = make_tiny_encoder(tmp_path / "embed", kind, pooling="cls_token")
    llm = LLM(model=str(d), device="cuda", dtype="float32")
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(got, torch.nn.functional.normalize(hf_encode(d, texts), dim=-1), rtol=0, atol=1e-4)
    _assert_clean(llm)
    d = make_tiny_encoder(tmp_path / "cross", kind, num_labels=1)
    llm = LLM(model=str(d), device="cuda", dtype="float32")
    got = torch.tensor([o.outputs.score for o in llm.score(texts[1], texts, use_tqdm=False)])
    torch.testing.assert_close(got, torch.sigmoid(hf_encode(d, [(texts[1], t) for t in texts])[:, 0]), rtol=0,
                               atol=1e-4)
    _assert_clean(llm)
