"""Pooling (engine.pooling; vLLM's --runner pooling): each prompt's embedding is the final hidden
state of its last token, as HF transformers' base model computes it, under every scheduling path
(chunked prefill, prefix-cache hits, a batch); `LLM.embed` and POST /v1/embeddings (the openai
client's base64 and float replies) give the same vectors; what a pooling engine cannot serve is
refused, saying why; every request's KV blocks come back."""
from __future__ import annotations

import asyncio
import base64
import importlib
import json
import re
import shutil
import struct

import openai
import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from engine.metric_sinks import MemorySinks
from tests.tiny_llama import make_tiny_llama

VOCAB = 49152  # SmolLM2's tokenizer, so that text inputs run
# lengths around the 32-token step budget and 16-token blocks: whole chunks, a chunk and a bit
LENGTHS = (3, 70, 33, 16)


def _prompts(n_vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, n_vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_path):
    """A generative Qwen3 (tied) and Llama (untied head) checkpoint, and the Llama one saved as a
    bare `LlamaModel` (no head, no `model.` prefix), as embedding checkpoints are."""
    from transformers import AutoModel

    out = {kind: make_tiny_llama(tmp_path_factory.mktemp(kind), smollm2_path, kind, vocab_size=VOCAB)
           for kind in ("qwen3", "gqa")}
    bare = tmp_path_factory.mktemp("bare")
    AutoModel.from_pretrained(str(out["gqa"])).save_pretrained(bare, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (out["gqa"] / name).exists():
            shutil.copy(out["gqa"] / name, bare / name)
    out["bare"] = bare
    return out


def hf_last_hidden(model_dir, prompts: list[list[int]], normalize: bool = True) -> list[torch.Tensor]:
    """HF's base model, one prompt at a time: the last token's final hidden state."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model(torch.tensor([p])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=-1) if normalize else h)
    return out


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == want.shape[0]
    assert torch.allclose(torch.tensor(got), want, atol=2e-6, rtol=0), (torch.tensor(got) - want).abs().max()


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()
    assert not eng.requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["qwen3", "gqa", "bare"])
def test_embeddings_are_hfs_last_hidden_state_under_chunked_prefill_and_prefix_hits(dirs, kind):
    prompts = _prompts()
    want = hf_last_hidden(dirs[kind], prompts)
    # the bare checkpoint pools by itself (runner auto); the generative ones are converted
    args = {} if kind == "bare" else {"runner": "pooling"}
    llm = LLM(str(dirs[kind]), max_num_batched_tokens=32, num_gpu_blocks_override=24, **args)
    assert llm.engine.executor.model.lm_head is None  # no head is built, nor read
    outs = llm.embed(prompts, use_tqdm=False)
    for out, p, w in zip(outs, prompts, want):
        assert out.prompt_token_ids == p and out.finished
        _assert_close(out.outputs.embedding, w)
    again = llm.embed([prompts[1], prompts[1][:40]], use_tqdm=False)  # whole blocks from the cache
    assert again[0].num_cached_tokens >= 64 and again[1].num_cached_tokens >= 32
    _assert_close(again[0].outputs.embedding, want[1])
    _assert_close(again[1].outputs.embedding, hf_last_hidden(dirs[kind], [prompts[1][:40]])[0])
    assert llm.engine.stats().generation_tokens == 0  # a vector is no generated token
    _assert_clean(llm)


def test_params_a_full_context_and_what_is_refused(dirs, tmp_path):
    d = dirs["qwen3"]
    prompts = _prompts()
    llm = LLM(str(d), runner="pooling", max_model_len=64, max_num_batched_tokens=32, num_gpu_blocks_override=24)
    raw = llm.embed(prompts[:1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    _assert_close(raw.outputs.embedding, hf_last_hidden(d, prompts[:1], normalize=False)[0])
    pooled = llm.encode(prompts[:1], use_tqdm=False)[0]
    assert isinstance(pooled.outputs.data, torch.Tensor) and pooled.outputs.data.shape == (64,)
    full = list(range(5, 69))  # all of max_model_len: nothing is generated after it
    _assert_close(llm.embed(full, use_tqdm=False)[0].outputs.embedding, hf_last_hidden(d, [full])[0])
    kept = llm.embed(prompts[1], use_tqdm=False, truncate_prompt_tokens=20)[0]
    assert kept.prompt_token_ids == prompts[1][:20]  # vLLM's pooling runner keeps the first tokens
    bidirectional = tmp_path / "bidirectional"
    shutil.copytree(d, bidirectional)
    cfg = json.loads((bidirectional / "config.json").read_text())
    (bidirectional / "config.json").write_text(json.dumps({**cfg, "is_causal": False}))
    with pytest.raises(ValueError, match="is_causal false .* causal only"):
        LLM(str(bidirectional), runner="pooling", num_gpu_blocks_override=24)
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        llm.embed(list(range(5, 70)), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        llm.embed(prompts[0], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="served for embeddings.*does not generate"):
        llm.generate(prompts[0], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="pooling task 'plugin' is not supported"):
        PoolingParams(task="plugin")
    with pytest.raises(InvalidRequestError, match="Task classify is not supported by this model: it pools for embed"):
        llm.classify(prompts[0], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):  # its full size too, as vLLM
        llm.embed(prompts[0], pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    for asked in (dict(n=2), dict(logprobs=1), dict(prompt_logprobs=1), dict(max_tokens=3)):  # params made by hand
        with pytest.raises(InvalidRequestError, match="a pooling request has no"):
            llm.generate(prompts[0], SamplingParams(**{"max_tokens": 1, **asked}, pooling=PoolingParams()),
                         use_tqdm=False)
    _assert_clean(llm)
    gen = LLM(str(d), num_gpu_blocks_override=24)
    with pytest.raises(InvalidRequestError, match="served for generation.*--runner pooling"):
        gen.embed(prompts[0], use_tqdm=False)
    _assert_clean(gen)


def test_metrics_count_the_prompts_and_generate_nothing(dirs):
    """vLLM's metrics (LLM(disable_log_stats=False)): an embedding's prompt tokens count once its
    vector is out, as a first token's would, and its request succeeds having generated nothing."""
    prompts = _prompts()
    llm = LLM(str(dirs["qwen3"]), runner="pooling", num_gpu_blocks_override=24, max_num_batched_tokens=32,
              disable_log_stats=False)
    llm.embed(prompts, use_tqdm=False)
    values = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}

    def value(name: str, **labels) -> float:
        [m] = [m for (n, tags), m in values.items() if n == name and labels.items() <= dict(tags).items()]
        return getattr(m, "value", None) if hasattr(m, "value") else m.count

    assert value("kvserve_prompt_tokens") == sum(LENGTHS)
    assert value("kvserve_generation_tokens") == 0
    assert value("kvserve_request_success", finished_reason="stop") == len(prompts)
    assert value("kvserve_time_to_first_token_seconds") == len(prompts)  # a histogram: its count


def test_matryoshka_dimensions_keep_the_leading_ones_normalised(dirs, tmp_path):
    d = tmp_path / "mrl"
    shutil.copytree(dirs["qwen3"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    prompts = _prompts()[:2]
    raw = hf_last_hidden(d, prompts, normalize=False)
    llm = LLM(str(d), runner="pooling", num_gpu_blocks_override=24)
    params = [PoolingParams(dimensions=16), PoolingParams()]  # in one batch: each its own size
    short, whole = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    _assert_close(short.outputs.embedding, torch.nn.functional.normalize(raw[0][:16], dim=-1))
    _assert_close(whole.outputs.embedding, torch.nn.functional.normalize(raw[1], dim=-1))
    with pytest.raises(InvalidRequestError, match=r"only supports dimensions \[16, 32, 64\], got 20"):
        llm.embed(prompts[0], pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    default = LLM(str(d), runner="pooling", num_gpu_blocks_override=24, pooler_config={"dimensions": 32})
    assert len(default.embed(prompts[0], use_tqdm=False)[0].outputs.embedding) == 32


def _sentence_transformers(src, dst, pooling: str, normalize: bool):
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, f"pooling_mode_{pooling}": True}))
    return dst


def test_a_sentence_transformers_folder_pools_as_its_modules_say(dirs, tmp_path):
    """runner auto pools it although its architecture is ...ForCausalLM (vLLM's rule); no
    Normalize module: vectors as they come, unless a request asks; a mean-pooling model is
    refused at start-up, and --pooler-config can say LAST over it."""
    d = _sentence_transformers(dirs["qwen3"], tmp_path / "st", "lasttoken", normalize=False)
    prompts = _prompts()[:2]
    llm = LLM(str(d), num_gpu_blocks_override=24)
    raw = hf_last_hidden(d, prompts, normalize=False)
    _assert_close(llm.embed(prompts[0], use_tqdm=False)[0].outputs.embedding, raw[0])
    asked = llm.embed(prompts[1], pooling_params=PoolingParams(use_activation=True), use_tqdm=False)[0]
    _assert_close(asked.outputs.embedding, torch.nn.functional.normalize(raw[1], dim=-1))
    cls = _sentence_transformers(dirs["qwen3"], tmp_path / "cls", "cls_token", normalize=True)
    with pytest.raises(ValueError, match="pooling type CLS is not supported"):
        LLM(str(cls), num_gpu_blocks_override=24)
    weighted = _sentence_transformers(dirs["qwen3"], tmp_path / "weighted", "weightedmean_tokens", normalize=True)
    with pytest.raises(ValueError, match="pooling type WEIGHTEDMEAN is not supported"):  # not taken for LAST
        LLM(str(weighted), num_gpu_blocks_override=24)
    with pytest.raises(ValueError, match="`normalize` was removed; use `use_activation`"):
        LLM(str(cls), pooler_config={"normalize": True})
    over = LLM(str(cls), num_gpu_blocks_override=24, pooler_config='{"pooling_type": "LAST"}')
    _assert_close(over.embed(prompts[0], use_tqdm=False)[0].outputs.embedding,
                  torch.nn.functional.normalize(raw[0], dim=-1))  # its Normalize module counts
    modules = json.loads((d / "modules.json").read_text())
    plain = tmp_path / "no-pooling"  # modules.json without a Pooling module says nothing (vLLM's reading)
    shutil.copytree(dirs["qwen3"], plain)
    (plain / "modules.json").write_text(json.dumps(modules[:1]))
    gen = LLM(str(plain), num_gpu_blocks_override=24)
    assert gen.engine.pooler is None and gen.generate(prompts[0], SamplingParams(max_tokens=2), use_tqdm=False)


def add_dense(folder, layers: list[tuple[int, int, bool, str]], seed: int = 0) -> list:
    """Dense modules (in, out, bias, activation's class path) saved into a sentence-transformers
    folder as sentence-transformers saves them, before its Normalize module; returns what each
    computes: (weight, bias or None, the activation's class path)."""
    from safetensors.torch import save_file

    modules = json.loads((folder / "modules.json").read_text())
    gen, made = torch.Generator().manual_seed(seed), []
    for i, (n_in, n_out, bias, act) in enumerate(layers):
        path = folder / f"{2 + i}_Dense"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"in_features": n_in, "out_features": n_out, "bias": bias,
                                                      "activation_function": act}))
        w = {"linear.weight": torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5}
        if bias:
            w["linear.bias"] = torch.randn(n_out, generator=gen) * 0.1
        save_file(w, str(path / "model.safetensors"))
        modules.insert(2 + i, {"idx": 2 + i, "name": str(2 + i), "path": path.name,
                               "type": "sentence_transformers.models.Dense"})
        made.append((w["linear.weight"], w.get("linear.bias"), act))
    (folder / "modules.json").write_text(json.dumps(modules))
    return made


def dense_applied(v: torch.Tensor, made: list) -> torch.Tensor:
    for weight, bias, act in made:
        module, _, name = act.rpartition(".")
        v = getattr(importlib.import_module(module), name)()(torch.nn.functional.linear(v, weight, bias))
    return v


def test_sentence_transformers_dense_modules_project_each_vector(dirs, tmp_path):
    """Dense modules after the pooling (LaBSE's tanh projection; a change of size), applied in
    order before the Normalize step, as sentence-transformers and vLLM apply them; under mean
    pooling's chunks too. What cannot be applied is refused at start-up, saying why."""
    d = _sentence_transformers(dirs["qwen3"], tmp_path / "dense", "mean_tokens", normalize=True)
    made = add_dense(d, [(64, 32, True, "torch.nn.modules.activation.Tanh"),
                         (32, 48, False, "torch.nn.modules.linear.Identity")])
    first = d / "2_Dense" / "config.json"  # no activation_function: sentence-transformers' default, Tanh
    first.write_text(json.dumps({k: v for k, v in json.loads(first.read_text()).items() if k != "activation_function"}))
    prompts = _prompts()
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        means = [model(torch.tensor([p])).last_hidden_state[0].mean(dim=0) for p in prompts]
    llm = LLM(str(d), max_num_batched_tokens=32, num_gpu_blocks_override=24)
    assert llm.engine.pooler.embedding_size == 48
    for out, mean in zip(llm.embed(prompts, use_tqdm=False), means):
        _assert_close(out.outputs.embedding, torch.nn.functional.normalize(dense_applied(mean, made), dim=-1))
    raw = llm.embed(prompts[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    _assert_close(raw.outputs.embedding, dense_applied(means[0], made))  # projected, not normalised
    _assert_clean(llm)
    def after_normalize(folder):  # sentence-transformers would project the normalised vector
        modules = json.loads((folder / "modules.json").read_text())
        (folder / "modules.json").write_text(json.dumps([m for m in modules if "Dense" not in m["type"]] +
                                                        [m for m in modules if "Dense" in m["type"]]))

    def with_config(**changes):
        def change(folder):
            cfg = folder / "2_Dense" / "config.json"
            cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **changes}))
        return change

    def stray_bias(folder):
        from safetensors.torch import save_file
        save_file({"linear.weight": torch.zeros(8, 64), "linear.bias": torch.zeros(8)},
                  str(folder / "2_Dense" / "model.safetensors"))

    for i, (layers, then, words) in enumerate((
            ([(64, 32, True, "torch.nn.modules.activation.Tanh"), (16, 8, True, "torch.nn.Identity")], None,
             "takes 16 features, but the one before it gives 32"),
            ([(64, 8, True, "os.system")], None, "kvserve applies torch.nn modules only"),
            ([(64, 8, True, "torch.nn.GLU")], None, "which kvserve cannot apply: ValueError: it changes the vector's"),
            ([(64, 8, True, "torch.nn.Module")], None, "which kvserve cannot apply: NotImplementedError"),
            ([(32, 8, True, "torch.nn.Identity")], None, "takes 32 features; the model's pooled vectors have 64"),
            ([(64, 8, True, "torch.nn.Tanh")], after_normalize, "outside the place kvserve applies them"),
            ([(64, 8, True, "torch.nn.Tanh")], with_config(use_residual=True), "use_residual=True, which kvserve "
                                                                                 "does not apply"),
            ([(64, 8, True, "torch.nn.Tanh")], with_config(activation_function=5), "is not an import path"),
            ([(64, 8, False, "torch.nn.Tanh")], stray_bias, "says bias false but has a linear.bias"))):
        bad = _sentence_transformers(dirs["qwen3"], tmp_path / f"bad{i}", "lasttoken", normalize=True)
        add_dense(bad, layers)
        if then is not None:
            then(bad)
        with pytest.raises(ValueError, match=re.escape(words)):
            LLM(str(bad), num_gpu_blocks_override=24)


def hf_mean_hidden(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's base model, one prompt at a time: the mean of every token's final hidden state, normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0].mean(dim=0), dim=-1)
                for p in prompts]


def test_mean_pooling_is_hfs_mean_under_chunks_and_the_prefix_cache(dirs, tmp_path):
    """A sentence-transformers folder that says mean pooling: every prompt row counts, through
    chunked prefill (rows in several steps, beside other requests') and a repeated prompt (no
    prefix-cache hit past the rows it has)."""
    d = _sentence_transformers(dirs["qwen3"], tmp_path / "mean", "mean_tokens", normalize=True)
    prompts = _prompts() + [_prompts()[1]]
    want = hf_mean_hidden(d, prompts)
    llm = LLM(str(d), max_num_batched_tokens=32, num_gpu_blocks_override=9, block_size=16)
    outs = llm.embed(prompts, use_tqdm=False)
    for out, w in zip(outs, want):
        _assert_close(out.outputs.embedding, w)
    assert outs[-1].num_cached_tokens == 0
    last = LLM(str(d), pooler_config={"pooling_type": "LAST"}, num_gpu_blocks_override=24)  # the folder's, overridden
    _assert_close(last.embed(prompts[1], use_tqdm=False)[0].outputs.embedding, hf_last_hidden(d, prompts[1:2])[0])
    _assert_clean(llm)


def hf_token_vectors(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's base model, one prompt at a time: every token's final hidden state, unnormalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def test_token_embed_gives_every_tokens_vector_under_chunks_and_the_prefix_cache(dirs, tmp_path):
    """vLLM's token_embed (ALL pooling): each prompt token's final state through the folder's
    Dense modules, each normalised, whatever the folder's own pooling (MEAN here); rows arriving
    over several chunked-prefill steps beside embed requests; no prefix-cache hit for it (every
    row is needed), and one for an embed request after it."""

    d = _sentence_transformers(dirs["qwen3"], tmp_path / "st", "mean_tokens", normalize=True)
    made = add_dense(d, [(64, 24, True, "torch.nn.modules.activation.Tanh")])
    prompts = _prompts()
    want = [torch.nn.functional.normalize(dense_applied(h, made), dim=-1).double()
            for h in hf_token_vectors(d, prompts)]
    llm = LLM(str(d), max_num_batched_tokens=32, num_gpu_blocks_override=24, block_size=16)
    tasks = ["token_embed", "embed", "token_embed", "token_embed"]
    outs = llm.encode(prompts, [PoolingParams(task=t) for t in tasks], use_tqdm=False)
    for out, w, task, p in zip(outs, want, tasks, prompts):
        got = out.outputs.data
        if task == "embed":  # the folder's MEAN pooling, beside them
            assert got.shape == (24,)
            continue
        assert got.shape == (len(p), 24)
        assert torch.allclose(got.double(), w, atol=2e-6, rtol=0), (got.double() - w).abs().max()
    again = llm.encode(prompts[1], pooling_task="token_embed", use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert torch.allclose(again.outputs.data.double(), want[1], atol=2e-6, rtol=0)
    last = LLM(str(d), pooler_config={"pooling_type": "LAST"}, num_gpu_blocks_override=24, block_size=16)
    first = last.encode(prompts[1], pooling_task="token_embed", use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    embed = last.embed(prompts[1], use_tqdm=False)[0]  # LAST after it: its prefix is cached
    assert embed.num_cached_tokens > 0 and torch.allclose(torch.tensor(embed.outputs.embedding), first.outputs.data[-1],
                                                          atol=1e-6, rtol=0)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):  # dimensions as for embed
        last.encode(prompts[1], PoolingParams(task="token_embed", dimensions=8), use_tqdm=False)
    _assert_clean(llm)
    _assert_clean(last)


# -- over HTTP ---------------------------------------------------------------------------------

def _serve(engine_config, tokenizer, go, engine_cls=None, sinks=None, **settings):
    """go(openai client, httpx client) against the API over an in-process EngineServer; `sinks`:
    where the replica's metrics go; `settings`: RouterSettings' fields."""
    from router.api import build_api
    from router.serving import OpenAIServing
    from router.settings import RouterSettings
    from tests.scripted_engine import served
    from workers.metrics import ReplicaMetrics
    from workers.server import EngineServer

    server = EngineServer(engine_config, engine_cls, metrics=None if sinks is None else ReplicaMetrics(sinks),
                          log_stats=False)
    app = build_api(OpenAIServing(tokenizer, server, RouterSettings(served_model_name="m", **settings)))

    async def main():
        try:
            async with served(app) as (http, base_url):
                client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", http_client=http, max_retries=0)
                result = await go(client, http)
            for _ in range(100):  # every request done, every block back (a finished one frees them within a step)
                stats = await server.stats()
                if stats.num_free_blocks == stats.num_total_blocks and not stats.num_running + stats.num_waiting:
                    break
                await asyncio.sleep(0.02)
            assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running + stats.num_waiting, stats
            return result
        finally:
            await server.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("engine_cls", [None, "engine.process_engine:ProcessEngine"], ids=["async", "process"])
def test_v1_embeddings_equal_llm_embed_through_the_openai_client(dirs, engine_cls):
    from engine.config import EngineConfig

    d = dirs["qwen3"]
    texts = ["The capital of France is", "hello world", "a b c d e f g h i j k l m n o p q r s t"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(str(d), runner="pooling", num_gpu_blocks_override=24)
    want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    want_chat = llm.embed(chat_ids, use_tqdm=False)[0].outputs.embedding
    kept = llm.embed(llm.tokenizer.encode(texts[2])[:5], pooling_params=PoolingParams(use_activation=False),
                     use_tqdm=False)[0].outputs.embedding
    want_full = llm.embed(list(range(5, 5 + 256)), use_tqdm=False)[0].outputs.embedding

    async def go(client, http):
        r = await client.embeddings.create(model="m", input=texts)  # the client asks base64, and decodes it
        assert [e.index for e in r.data] == [0, 1, 2] and r.model == "m"
        for e, w in zip(r.data, want):
            assert e.embedding == pytest.approx(w, abs=1e-6)
        ntok = sum(len(llm.tokenizer.encode(t)) for t in texts)
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (ntok, ntok)
        r = await http.post("/v1/embeddings", json={"model": "m", "input": texts[0], "encoding_format": "float"})
        assert r.status_code == 200 and r.json()["object"] == "list"
        assert r.json()["data"][0]["embedding"] == pytest.approx(want[0], abs=1e-6)
        for task in (None, "embed"):  # vLLM's /pooling: the same vectors, each a "pooling" object's `data`
            r = await http.post("/pooling", json={"model": "m", "input": texts, "task": task})
            assert r.json()["id"].startswith("pool-") and [d["object"] for d in r.json()["data"]] == ["pooling"] * 3
            for d, w in zip(r.json()["data"], want):
                assert d["data"] == pytest.approx(w, abs=1e-6)
        r = await http.post("/pooling", json={"input": texts[0], "encoding_format": "base64"})
        packed = base64.b64decode(r.json()["data"][0]["data"])
        assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(want[0], abs=1e-6)
        # vLLM's embed_dtype and endianness: each value of the float reply as that type, in that byte order
        r = await http.post("/v1/embeddings", json={"input": texts[0]})
        floats = torch.tensor(r.json()["data"][0]["embedding"], dtype=torch.float32)
        for dtype, view, order in (("float16", torch.int16, "little"), ("bfloat16", torch.int16, "big"),
                                   ("fp8_e4m3", torch.uint8, "native"), ("float32", torch.int32, "big")):
            r = await http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64",
                                                        "embed_dtype": dtype, "endianness": order})
            raw = bytearray(base64.b64decode(r.json()["data"][0]["embedding"]))
            width = torch.tensor([], dtype=view).element_size()
            if order == "big":
                raw = b"".join(raw[i:i + width][::-1] for i in range(0, len(raw), width))
            torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                           "float32": torch.float32}[dtype]
            got = torch.frombuffer(bytearray(raw), dtype=view).view(torch_dtype).float()
            assert torch.equal(got, floats.to(torch_dtype).float()), dtype
        r = await http.post("/v1/embeddings", json={"input": texts[0], "embed_dtype": "int8"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "embed_dtype", r.text
        # vLLM's binary replies: the vectors' bytes as the body, what each is in a `metadata` header
        for path in ("/v1/embeddings", "/pooling"):
            r = await http.post(path, json={"input": texts[:2], "encoding_format": "bytes", "embed_dtype": "float16"})
            assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
            meta = json.loads(r.headers["metadata"])
            assert meta["usage"]["prompt_tokens"] > 0 and [d["index"] for d in meta["data"]] == [0, 1]
            for d, w in zip(meta["data"], want):
                assert d["shape"] == [len(w)] and d["embed_dtype"] == "float16" and d["endianness"] == "native"
                got = torch.frombuffer(bytearray(r.content[d["start"]:d["end"]]), dtype=torch.float16).float()
                assert torch.allclose(got, torch.tensor(w), atol=1e-3, rtol=0)
        r = await http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "bytes_only"})
        assert "metadata" not in r.headers and list(struct.unpack(f"<{len(r.content) // 4}f", r.content)) == \
            pytest.approx(want[0], abs=1e-6)
        for body in ({"model": "m", "messages": chat}, {"input": chat}):  # vLLM's chat embeddings, both forms
            r = await http.post("/v1/embeddings", json=body)
            assert r.json()["data"][0]["embedding"] == pytest.approx(want_chat, abs=1e-6)
        ids = llm.tokenizer.encode(texts[2])  # 20 tokens
        r = await http.post("/v1/embeddings", json={"input": [ids], "truncate_prompt_tokens": 5,
                                                    "use_activation": False})
        assert r.json()["usage"]["prompt_tokens"] == 5
        assert r.json()["data"][0]["embedding"] == pytest.approx(kept, abs=1e-6)
        full = list(range(5, 5 + 256))  # all of max_model_len: nothing is generated after it
        for body in ({"input": full}, {"input": full + [7] * 50, "truncate_prompt_tokens": -1}):
            r = await http.post("/v1/embeddings", json=body)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256, r.text
        assert r.json()["data"][0]["embedding"] == pytest.approx(want_full, abs=1e-6)
        refused = {}
        for name, body in {"dimensions": {"input": "x", "dimensions": 8}, "empty": {"input": ""},
                           "long": {"input": "x " * 300}, "ids": {"input": [[1, 2, VOCAB]]},
                           "normalize": {"input": "x", "normalize": True}, "both": {"input": "x", "messages": chat},
                           "many": {"input": ["x"] * 2049}, "completions": None, "responses": None,
                           "task": None}.items():
            if name == "task":
                r = await http.post("/pooling", json={"input": "x", "task": "classify"})
            elif name == "completions":
                r = await http.post("/v1/completions", json={"prompt": "hi"})
            elif name == "responses":  # refused at once, not queued to fail later
                r = await http.post("/v1/responses", json={"input": "hi", "background": True})
            else:
                r = await http.post("/v1/embeddings", json=body)
            refused[name] = (r.status_code, r.json()["error"]["message"])
        return refused

    sinks = MemorySinks("m")
    refused = _serve(EngineConfig(model=str(d), runner="pooling", max_model_len=256, num_gpu_blocks_override=48),
                     llm.tokenizer, go, engine_cls, sinks)
    counted = {m.name: m for m in sinks.read() if not m.labels.keys() - {"model_name"}}
    assert counted["kvserve_prompt_tokens"].value > sum(len(llm.tokenizer.encode(t)) for t in texts)  # and more
    assert counted["kvserve_generation_tokens"].value == 0
    assert all(status == 400 for status, _ in refused.values()), refused
    assert "does not support Matryoshka" in refused["dimensions"][1]
    assert "maximum context length is 256 tokens, but the input has" in refused["long"][1]
    assert f"must be in [0, {VOCAB})" in refused["ids"][1]
    assert "use `use_activation` instead" in refused["normalize"][1]
    assert "give exactly one of input or messages" in refused["both"][1]
    assert "served for embeddings" in refused["completions"][1] and "served for embeddings" in refused["responses"][1]
    assert "2049 inputs" in refused["many"][1] and "at most 2048" in refused["many"][1]
    assert "Task classify is not supported" in refused["task"][1]
    assert "the prompt is empty" in refused["empty"][1]  # an empty text that tokenizes to nothing


def test_a_generating_server_says_how_to_serve_embeddings(dirs, tokenizer):
    from engine.config import EngineConfig

    async def go(client, http):
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            await client.embeddings.create(model="m", input="hi")

    _serve(EngineConfig(model=str(dirs["qwen3"]), max_model_len=128, num_gpu_blocks_override=24), tokenizer, go)
