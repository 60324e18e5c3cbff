"""Sequence classifiers (engine.classifier; vLLM's classify task, and its score task on a
cross-encoder): a `...ForSequenceClassification` checkpoint's probabilities are HF transformers'
softmax (sigmoid with one label) of its head's logits, under chunked prefill and prefix-cache
hits; a cross-encoder scores each text pair read as one prompt, the tokenizer's pair encoding,
as HF does; `LLM.classify`/`LLM.score`, POST /classify, /pooling, /score and /rerank give the
same numbers; what a model cannot serve is refused, saying why; every KV block comes back."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, PoolingParams
from engine.classifier import classifier
from engine.errors import InvalidRequestError
from tests.test_embeddings import LENGTHS, VOCAB, _assert_clean, _prompts, _serve
from tests.tiny_llama import make_tiny_classifier, make_tiny_llama

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Bananas are yellow.", "Paris", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_path):
    """A Qwen3 classifier over three named labels; Llama cross-encoders (one label): as HF saves
    one, one whose config joins a pair's texts (use_pad_token false), and one whose
    sentence-transformers config applies no activation; and the Qwen3 body as an embedding model."""
    qwen3 = make_tiny_llama(tmp_path_factory.mktemp("qwen3"), smollm2_path, "qwen3", vocab_size=VOCAB)
    gqa = make_tiny_llama(tmp_path_factory.mktemp("gqa"), smollm2_path, "gqa", vocab_size=VOCAB)
    out = {"labels3": make_tiny_classifier(qwen3, tmp_path_factory.mktemp("labels3"), 3, id2label=LABELS),
           "cross": make_tiny_classifier(gqa, tmp_path_factory.mktemp("cross"), 1), "embed": qwen3, "gqa": gqa}
    for kind, change in (("joined", {"use_pad_token": False}),
                         ("identity", {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}})):
        out[kind] = tmp_path_factory.mktemp(kind)
        shutil.copytree(out["cross"], out[kind], dirs_exist_ok=True)
        cfg = json.loads((out[kind] / "config.json").read_text())
        (out[kind] / "config.json").write_text(json.dumps({**cfg, **change}))
    return out


def hf_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's classifier, one prompt at a time: its head's logits over the last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def test_a_heads_activation_follows_its_configs_problem_type():
    def head(**cfg):
        return classifier(SimpleNamespace(**{"num_labels": 3, "id2label": LABELS, **cfg}))

    assert (head().classify_activation, head().tasks, head().labels) == ("softmax", ("classify",),
                                                                        ("negative", "neutral", "positive"))
    assert head(problem_type="multi_label_classification").classify_activation == "sigmoid"
    assert head(problem_type="regression").classify_activation is None
    one = head(num_labels=1, id2label={0: "LABEL_0"})
    assert (one.classify_activation, one.score_activation, one.tasks) == ("sigmoid", "sigmoid", ("classify", "score"))
    assert head(num_labels=1, sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"
                ).score_activation is None
    regression = head(num_labels=1, problem_type="regression",
                      sentence_transformers={"activation_fn": "torch.nn.modules.activation.Sigmoid"})
    assert (regression.classify_activation, regression.score_activation) == (None, "sigmoid")
    assert head().label([0.1, 0.7, 0.2]) == "neutral"
    with pytest.raises(ValueError, match="Tanh"):
        head(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"})


def test_classify_is_hfs_softmax_under_chunked_prefill_and_prefix_hits(dirs):
    prompts = _prompts()
    prompts.append(prompts[1][:40] + [7, 8, 9])  # 32 of its 43 tokens hit the prefix cache (two 16-token blocks)
    want = hf_logits(dirs["labels3"], prompts)
    llm = LLM(str(dirs["labels3"]), num_gpu_blocks_override=24, max_num_batched_tokens=32, enable_prefix_caching=True)
    outs = llm.classify(prompts, use_tqdm=False)
    assert outs[-1].num_cached_tokens == 32
    for out, logits in zip(outs, want):
        assert out.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(out.outputs.probs), logits.softmax(-1), atol=2e-6, rtol=0)
    raw = llm.classify(prompts[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits in zip(raw, want):
        assert torch.allclose(torch.tensor(out.outputs.probs), logits, atol=2e-5, rtol=0)
    assert [len(o.prompt_token_ids) for o in outs[:len(LENGTHS)]] == list(LENGTHS)
    for call, words in ((lambda: llm.embed(prompts[:1], use_tqdm=False), "Task embed is not supported"),
                        (lambda: llm.score(QUERY, DOCS, use_tqdm=False), "Task score is not supported"),
                        (lambda: llm.classify(prompts[:1], pooling_params=PoolingParams(dimensions=2), use_tqdm=False),
                         "dimensions")):
        with pytest.raises(InvalidRequestError, match=words):
            call()
    _assert_clean(llm)


@pytest.mark.parametrize("kind", ["cross", "joined", "identity"])
def test_a_cross_encoder_scores_each_pair_as_hf_reads_it(dirs, kind):
    """1:N and N:N; the pair's prompt is the tokenizer's pair encoding, or the two texts joined
    where the config says use_pad_token false; the score HF's logit under the model's activation."""
    llm = LLM(str(dirs[kind]), num_gpu_blocks_override=24, max_num_batched_tokens=32)
    tok = llm.tokenizer
    for firsts, seconds, pairs in (([QUERY], DOCS, [(QUERY, d) for d in DOCS]),
                                   (DOCS[:2], DOCS[2:], list(zip(DOCS[:2], DOCS[2:])))):
        ids = [tok(a, text_pair=b)["input_ids"] if kind != "joined" else tok(a + b)["input_ids"] for a, b in pairs]
        logits = torch.stack(hf_logits(dirs[kind], ids))[:, 0]
        want = logits if kind == "identity" else logits.sigmoid()
        outs = llm.score(firsts if len(firsts) > 1 else firsts[0], seconds, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == ids
        assert [o.outputs.score for o in outs] == pytest.approx(want.tolist(), abs=1e-5)  # logits of a few units
    if kind == "cross":
        assert ids[0] != tok(DOCS[0] + DOCS[2])["input_ids"] or tok(DOCS[0])["input_ids"]  # the pair encoding ran
        probs = llm.classify(DOCS[:1], use_tqdm=False)[0].outputs.probs  # one label: a sigmoid
        assert probs == pytest.approx([hf_logits(dirs[kind], [tok(DOCS[0])["input_ids"]])[0][0].sigmoid().item()],
                                      abs=2e-6)
        with pytest.raises(ValueError, match="pairs of texts"):
            llm.score([1, 2, 3], DOCS, use_tqdm=False)
        cut = llm.score({"prompt": QUERY}, DOCS[3], truncate_prompt_tokens=8, use_tqdm=False)[0]  # as a pair:
        want_ids = tok(QUERY, text_pair=DOCS[3], truncation=True, max_length=8)["input_ids"]  # the longer side cut
        assert cut.prompt_token_ids == want_ids and want_ids[:2] == tok(QUERY)["input_ids"][:2]
        assert cut.outputs.score == pytest.approx(hf_logits(dirs[kind], [want_ids])[0][0].sigmoid().item(), abs=2e-6)
    _assert_clean(llm)


def test_a_classifier_checkpoint_is_refused_for_generation_and_mean_pooling(dirs):
    from engine import SamplingParams

    llm = LLM(str(dirs["labels3"]), num_gpu_blocks_override=8, pooler_config={"use_activation": False})
    prompt = _prompts()[0]
    assert llm.classify(prompt, use_tqdm=False)[0].outputs.probs == pytest.approx(  # the pooler's default: logits
        hf_logits(dirs["labels3"], [prompt])[0].tolist(), abs=2e-5)
    with pytest.raises(InvalidRequestError, match="served for classification .* use LLM.classify"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(str(dirs["labels3"]), runner="generate", num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="scores its last token"):
        LLM(str(dirs["labels3"]), num_gpu_blocks_override=8, pooler_config={"pooling_type": "MEAN"})


def test_a_decoder_token_classifier_is_refused(dirs, tmp_path):
    """kvserve's decoders read one token's state: a ...ForTokenClassification head over every token
    is served for encoders only (engine.model.bert), under either runner."""
    import json
    import shutil

    d = tmp_path / "tagger"
    shutil.copytree(dirs["labels3"], d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForTokenClassification"]}))
    for runner in ("auto", "pooling", "generate"):
        with pytest.raises(ValueError, match="served for encoders .* only"):
            LLM(str(d), runner=runner, num_gpu_blocks_override=8)


@pytest.mark.parametrize("engine_cls", [None, "engine.process_engine:ProcessEngine"], ids=["async", "process"])
def test_http_classify_score_and_rerank_equal_the_offline_calls(dirs, engine_cls):
    from engine.config import EngineConfig

    texts = ["hello world", "The capital of France is Paris."]
    llm3 = LLM(str(dirs["labels3"]), num_gpu_blocks_override=24)
    want = [o.outputs.probs for o in llm3.classify(texts, use_tqdm=False)]
    cross = LLM(str(dirs["cross"]), num_gpu_blocks_override=24)
    scores = [o.outputs.score for o in cross.score(QUERY, DOCS, use_tqdm=False)]
    pair_tokens = sum(len(o.prompt_token_ids) for o in cross.score(QUERY, DOCS, use_tqdm=False))

    async def classify(client, http):
        r = await http.post("/classify", json={"model": "m", "input": texts})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "m"
        for i, (d, w) in enumerate(zip(body["data"], want)):
            assert (d["index"], d["num_classes"], d["label"]) == (i, 3, LABELS[max(range(3), key=w.__getitem__)])
            assert d["probs"] == pytest.approx(w, abs=1e-6)
        ntok = sum(len(llm3.tokenizer.encode(t)) for t in texts)
        assert body["usage"] == {"prompt_tokens": ntok, "total_tokens": ntok, "completion_tokens": 0}
        pooled = (await http.post("/pooling", json={"model": "m", "input": texts})).json()  # its task: classify
        assert sum([d["data"] for d in pooled["data"]], []) == pytest.approx(sum(want, []), abs=1e-6)
        for path, extra, param, words in (
                ("/v1/embeddings", {}, "model", "Task embed"), ("/pooling", {"task": "embed"}, "task", "Task embed"),
                ("/score", {"text_1": "a", "text_2": "b"}, "model", "with 3 labels"),
                ("/classify", {"input": ["a", ""]}, "input", "the prompt is empty")):
            body = {"model": "m", **({} if "text_1" in extra else {"input": "x"}), **extra}
            r = await http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert words in r.json()["error"]["message"] and (param is None or r.json()["error"]["param"] == param)
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["message"].endswith("does not generate; use /classify"), r.text

    async def score(client, http):
        r = await http.post("/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(scores, abs=1e-6)
        assert r.json()["usage"]["prompt_tokens"] == pair_tokens
        r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2})
        assert r.status_code == 200, r.text
        best = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
        assert [(x["index"], x["document"]["text"]) for x in r.json()["results"]] == [(i, DOCS[i]) for i in best]
        assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx([scores[i] for i in best], abs=1e-6)
        cut = cross.tokenizer.decode(cross.tokenizer.encode(DOCS[3])[:3])  # Cohere's max_tokens_per_doc
        r = await http.post("/rerank", json={"model": "m", "query": QUERY, "documents": [DOCS[3]],
                                             "max_tokens_per_doc": 3})
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(
            cross.score(QUERY, cut, use_tqdm=False)[0].outputs.score, abs=1e-6)
        r = await http.post("/classify", json={"model": "m", "input": [QUERY, "b"]})  # one label: a sigmoid
        assert [d["probs"][0] for d in r.json()["data"]] == pytest.approx(
            [o.outputs.probs[0] for o in cross.classify([QUERY, "b"], use_tqdm=False)], abs=1e-6)
        long = " ".join(["word"] * 300)
        r = await http.post("/score", json={"model": "m", "queries": QUERY, "documents": long})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
        for keep in (8, 200, -1):  # the pair cut as one, the query kept; -1: the server's max_model_len, 256
            r = await http.post("/score", json={"model": "m", "text_1": QUERY, "text_2": long,
                                                "truncate_prompt_tokens": keep})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == (256 if keep == -1 else keep)
            assert r.json()["data"][0]["score"] == pytest.approx(cross.score(
                QUERY, long, truncate_prompt_tokens=keep if keep > 0 else 256, use_tqdm=False)[0].outputs.score,
                abs=1e-6)
        r = await http.post("/rerank", json={"model": "m", "query": QUERY, "documents": DOCS,
                                             "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text

    _serve(EngineConfig(model=str(dirs["labels3"]), num_gpu_blocks_override=24), llm3.tokenizer, classify, engine_cls)
    _serve(EngineConfig(model=str(dirs["cross"]), num_gpu_blocks_override=24, max_model_len=256), cross.tokenizer,
           score, engine_cls)


def test_an_embedding_model_does_not_classify(dirs):
    from engine.config import EngineConfig

    llm = LLM(str(dirs["embed"]), runner="pooling", num_gpu_blocks_override=24)
    with pytest.raises(InvalidRequestError, match="Task classify is not supported by this model: it pools for embed"):
        llm.classify(["hello"], use_tqdm=False)

    async def go(client, http):
        r = await http.post("/classify", json={"model": "m", "input": "hello"})
        assert r.status_code == 400 and "an embedding model" in r.json()["error"]["message"], r.text
        r = await http.post("/pooling", json={"model": "m", "input": "hello", "task": "classify"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text

    _serve(EngineConfig(model=str(dirs["embed"]), runner="pooling", num_gpu_blocks_override=24), llm.tokenizer, go)


QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}  # vLLM's hf_overrides for Qwen3-Reranker


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Where the overridden views of model folders go (engine.hf_overrides)."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_last_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


@pytest.mark.parametrize("kind", ["embed", "gqa"])
def test_a_causal_lm_made_a_reranker_scores_its_yes_over_its_no(dirs, kind, cache):
    """vLLM's hf_overrides for Qwen3-Reranker: the head rows of "no" and "yes" make a one-label
    classifier whose score is the softmax of "yes" over the two (tied: the embedding's rows; an
    untied Llama: its lm_head's); a pair is its two texts joined, formatted by the caller."""
    from engine.config import EngineConfig

    arch = "Qwen3ForSequenceClassification" if kind == "embed" else "LlamaForSequenceClassification"
    overrides = {**QWEN3_RERANKER, "architectures": [arch]}
    llm = LLM(str(dirs[kind]), hf_overrides=overrides, num_gpu_blocks_override=24, max_num_batched_tokens=32)
    tok = llm.tokenizer
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    query, docs = f"<Query>: {QUERY}\n", [f"<Document>: {d}\n" for d in DOCS]
    ids = [tok(query + d)["input_ids"] for d in docs]
    want = [torch.stack([l[no], l[yes]]).softmax(0)[1].item() for l in hf_last_logits(dirs[kind], ids)]
    outs = llm.score(query, docs, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=2e-6)
    _assert_clean(llm)
    views = list(cache.glob("overrides/*/*"))
    assert [v.name for v in views] == [dirs[kind].name]  # named as the folder, links to its files
    assert (views[0] / "model.safetensors").resolve() == (dirs[kind] / "model.safetensors").resolve()
    LLM(str(dirs[kind]), hf_overrides=overrides, num_gpu_blocks_override=8)
    assert list(cache.glob("overrides/*/*")) == views  # made once
    one = LLM(str(dirs[kind]), num_gpu_blocks_override=8, hf_overrides={  # bge-reranker-v2-gemma's kind
        "architectures": [arch], "classifier_from_token": ["yes"], "method": "no_post_processing"})
    assert one.score(query, docs[0], use_tqdm=False)[0].outputs.score == pytest.approx(
        hf_last_logits(dirs[kind], ids[:1])[0][yes].sigmoid().item(), abs=2e-6)
    assert len(list(cache.glob("overrides/*/*"))) == 2

    async def go(client, http):
        r = await http.post("/rerank", json={"model": "m", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [got[i] for i in range(len(docs))] == pytest.approx(want, abs=2e-6)

    _serve(EngineConfig(model=str(dirs[kind]), hf_overrides=overrides, num_gpu_blocks_override=24), tok, go)


def test_hf_overrides_set_config_fields_and_refuse_what_cannot_be_made(dirs, cache):
    vector = LLM(str(dirs["embed"]), runner="pooling", num_gpu_blocks_override=8, pooler_config={
        "use_activation": False}).embed(["hello world"], use_tqdm=False)[0].outputs.embedding
    llm = LLM(str(dirs["embed"]), runner="pooling", num_gpu_blocks_override=8, hf_overrides='{"is_matryoshka": true}')
    cut = llm.embed(["hello world"], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert cut == pytest.approx(torch.nn.functional.normalize(torch.tensor(vector[:8]), dim=0).tolist(), abs=1e-6)
    for overrides, words in (("[1]", "must be a dict"), ("{", "not JSON"),
                             ({"classifier_from_token": ["no", "yes"], "method": "softmax"},
                              "method 'softmax' is not supported"),
                             ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "two tokens"),
                             ({"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"},
                              "give its architecture")):
        with pytest.raises(ValueError, match=words):
            LLM(str(dirs["embed"]), hf_overrides=overrides)
    with pytest.raises(ValueError, match="not tokens of the model's vocabulary"):
        LLM(str(dirs["embed"]), hf_overrides={**QWEN3_RERANKER, "classifier_from_token": ["no", "\u2603\u2603x"]})


def test_a_view_follows_its_folder_and_a_folders_own_config_converts(dirs, cache, tmp_path):
    """A view is made again where the folder's weights were replaced (same size, new head rows) or
    the view was damaged; a folder whose own config.json asks the conversion converts without
    overrides; override values are read as config.json holds them (a tuple as a list)."""
    import safetensors.torch

    folder = tmp_path / "reranker"
    shutil.copytree(dirs["embed"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **QWEN3_RERANKER}))  # the folder asks it itself
    tok = LLM(str(folder), num_gpu_blocks_override=8).tokenizer
    prompt = tok(f"<Query>: {QUERY}\n<Document>: {DOCS[0]}\n")["input_ids"]
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])

    def scored() -> tuple[float, float]:
        llm = LLM(str(folder), num_gpu_blocks_override=8, hf_overrides={"eos_token_id": (2, 3)})
        got = llm.classify({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs.probs[0]
        logits = hf_last_logits(dirs["embed"] if folder_weights == "old" else folder, [prompt])[0]
        return got, torch.stack([logits[no], logits[yes]]).softmax(0)[1].item()

    folder_weights = "old"
    got, want = scored()
    assert got == pytest.approx(want, abs=2e-6)
    weights = safetensors.torch.load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][[no, yes]] *= -1  # new head rows, same file size
    safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    folder_weights = "new"
    got_new, want_new = scored()
    assert got_new == pytest.approx(want_new, abs=2e-6) and abs(got_new - got) > 1e-3
    views = sorted(cache.glob("overrides/*/*"))
    assert len(views) == 3  # without overrides, and with them over the old weights and over the new
    for view in views:
        (view / "kvserve_source.json").write_text("{damaged")
    assert scored()[0] == pytest.approx(got_new, abs=1e-7) and sorted(cache.glob("overrides/*/*")) == views
