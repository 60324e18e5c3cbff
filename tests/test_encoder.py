"""Encoder models (engine.model.bert, engine.model.modernbert): BERT, RoBERTa, XLM-RoBERTa and
ModernBERT checkpoints embed as HF
transformers and sentence-transformers pool them (CLS, MEAN, LAST), and their cross-encoders
score a pair as HF reads it (BERT's second token type included); each prompt runs whole, many
lengths in one step, with no KV cache; truncation keeps [CLS] and [SEP]; what an encoder
cannot do is refused, saying why; every block the scheduler counted comes back."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, PoolingParams
from engine.errors import InvalidRequestError
from engine.sampling_params import framing_tokens, truncated
from tests.test_embeddings import _assert_clean, _serve
from tests.tiny_bert import gte_hub_format, hf_encode, make_tiny_encoder, nomic_hub_format

TEXTS = ["the capital of france is paris", "what city", "a dog runs fast in the blue sky and the sea",
         "who wrote the book", "cat", "the river and the sea and the sky runs slow on a blue dog"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog runs fast", "blue sky", "who wrote the book on the river"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def make(name, kind, **kw):
        return make_tiny_encoder(tmp_path_factory.mktemp(name), kind, **kw)

    return {"bert-cls": make("bert-cls", "bert", pooling="cls_token"),
            "bert-short": make("bert-short", "bert", pooling="mean_tokens", max_seq_length=16),
            "bert-mean": make("bert-mean", "bert", pooling="mean_tokens", normalize=False),
            "roberta-last": make("roberta-last", "roberta", pooling="lasttoken"),
            "distil-mean": make("distil-mean", "distilbert", pooling="mean_tokens"),
            "xlmr-bare": make("xlmr-bare", "xlm-roberta"),  # no sentence-transformers modules: CLS, normalised
            "bert-ce": make("bert-ce", "bert", num_labels=1), "xlmr-ce": make("xlmr-ce", "xlm-roberta", num_labels=1),
            "bert-3": make("bert-3", "bert", num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"}),
            "distil-2": make("distil-2", "distilbert", num_labels=2)}  # sst-2's shape: pre_classifier, ReLU


MODES = {"bert-cls": ("cls_token", True), "bert-mean": ("mean_tokens", False), "roberta-last": ("lasttoken", True),
         "xlmr-bare": ("cls_token", True), "distil-mean": ("mean_tokens", True)}


@pytest.mark.parametrize("name", list(MODES))
def test_an_encoder_embeds_as_hf_and_sentence_transformers_pool(dirs, name):
    pooling, normalized = MODES[name]
    want = hf_encode(dirs[name], TEXTS, pooling)
    if normalized:
        want = torch.nn.functional.normalize(want, dim=-1)
    # two prompts a step at most: steps of prompts of different lengths
    llm = LLM(str(dirs[name]), max_num_seqs=2, max_num_batched_tokens=128)
    assert not llm.engine.config.enable_chunked_prefill and not llm.engine.config.enable_prefix_caching
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(t) for t in TEXTS]
    again = llm.embed(TEXTS[:1], use_tqdm=False)[0]  # no prefix cache: nothing reused, the same vector
    assert again.num_cached_tokens == 0 and again.outputs.embedding == outs[0].outputs.embedding
    _assert_clean(llm)


def test_an_encoder_with_a_dense_module_projects_as_labse(tmp_path):
    """LaBSE's modules: CLS pooling, a Dense module with tanh, Normalize."""
    from tests.test_embeddings import add_dense, dense_applied

    d = make_tiny_encoder(tmp_path / "labse", "bert", pooling="cls_token")
    made = add_dense(d, [(64, 64, True, "torch.nn.modules.activation.Tanh")])
    want = torch.nn.functional.normalize(dense_applied(hf_encode(d, TEXTS), made), dim=-1)
    llm = LLM(str(d), max_num_seqs=2)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()
    _assert_clean(llm)


def hf_pair_logits(model_dir, pairs, token_types: bool = True, keep=None) -> torch.Tensor:
    """HF's logits of each (query, document) pair as its tokenizer encodes it; `keep`: of the
    tokens at those positions only, each with its own token type."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    out = []
    with torch.no_grad():
        for q, d in pairs:
            enc = tok(q, d, return_tensors="pt")
            if not token_types:
                enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
            if keep is not None:
                enc = {k: v[:, keep] for k, v in enc.items()}
            out.append(model(**enc).logits[0])
    return torch.stack(out)


def test_a_roberta_classifiers_unused_pooler_is_not_read_as_its_head(dirs, tmp_path):
    """Some RoBERTa classifiers ship `roberta.pooler.*` (cardiffnlp's): HF's head never reads it."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "pooled"
    shutil.copytree(dirs["xlmr-ce"], d)
    weights = load_file(d / "model.safetensors")
    weights |= {"roberta.pooler.dense.weight": torch.randn(64, 64), "roberta.pooler.dense.bias": torch.randn(64)}
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    want = torch.sigmoid(hf_pair_logits(d, [(QUERY, x) for x in DOCS])[:, 0])
    got = torch.tensor([o.outputs.score for o in LLM(str(d)).score(QUERY, DOCS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)


@pytest.mark.parametrize("name", ["bert-ce", "xlmr-ce"])
def test_an_encoder_cross_encoder_scores_each_pair_as_hf(dirs, name):
    pairs = [(QUERY, d) for d in DOCS]
    want = torch.sigmoid(hf_pair_logits(dirs[name], pairs)[:, 0])
    llm = LLM(str(dirs[name]))
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)
    if name == "bert-ce":  # the document's tokens are BERT's second segment: without it the scores differ
        flat = torch.sigmoid(hf_pair_logits(dirs[name], pairs, token_types=False)[:, 0])
        assert (flat - want).abs().max() > 1e-4
    # a query holding a literal [SEP]: the second type still starts at the document, as HF's
    odd = [("what [SEP] city is the capital", DOCS[0]), ("a [SEP] b [SEP] c", "[SEP] blue sky [SEP]")]
    want = torch.sigmoid(hf_pair_logits(dirs[name], odd)[:, 0])
    got = torch.tensor([o.outputs.score for o in llm.score([q for q, _ in odd], [d for _, d in odd],
                                                             use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)
    # a text alone is one segment (token type 0), whatever [SEP] it holds
    alone = llm.classify([f"{QUERY} [SEP] {DOCS[0]}"], use_tqdm=False)[0].outputs.probs[0]
    assert alone == pytest.approx(torch.sigmoid(hf_encode(dirs[name], [f"{QUERY} [SEP] {DOCS[0]}"])[0, 0]).item(),
                                  abs=2e-6)
    _assert_clean(llm)


SCORE_TEMPLATE = ("{{ instruction | default('judge') }}: {% for m in messages %}{{ m.role }} {{ m.content }} "
                  "{% endfor %}")


def test_a_score_template_renders_each_pair_offline_and_over_http(dirs):
    """vLLM's score template (--chat-template on a cross-encoder, LLM.score's chat_template, as
    Qwen3-Reranker is served): each pair rendered from its query and document messages, with a
    request's instruction, then read as one text; without a template an instruction is a 400."""
    from engine.config import EngineConfig

    d = dirs["bert-ce"]
    llm = LLM(str(d))

    def rendered(query, doc, **variables):
        return llm.tokenizer.apply_chat_template([{"role": "query", "content": query},
                                                  {"role": "document", "content": doc}],
                                                 chat_template=SCORE_TEMPLATE, tokenize=False, **variables)

    want = torch.sigmoid(hf_encode(d, [rendered(QUERY, x) for x in DOCS])[:, 0])
    assert (want - torch.sigmoid(hf_encode(d, [(QUERY, x) for x in DOCS])[:, 0])).abs().max() > 1e-4
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, chat_template=SCORE_TEMPLATE,
                                                           use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)
    told = torch.sigmoid(hf_encode(d, [rendered(QUERY, x, instruction="find the city") for x in DOCS])[:, 0])

    async def go(client, http):
        r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS})
        assert [x["score"] for x in r.json()["data"]] == pytest.approx(want.tolist(), abs=1e-6), r.text
        r = await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "find the city"})
        assert sorted((x["index"], x["relevance_score"]) for x in r.json()["results"]) == [
            (i, pytest.approx(s, abs=1e-6)) for i, s in enumerate(told.tolist())], r.text
        r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS[0],
                                            "chat_template_kwargs": {"instruction": "find the city"}})
        assert r.json()["data"][0]["score"] == pytest.approx(told[0].item(), abs=1e-6)
        r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS[0], "chat_template_kwargs": {"tools": 1}})
        assert r.status_code == 400 and "may not set tools" in r.json()["error"]["message"], r.text
        for body, param in (({"instruction": "sky " * 200}, "instruction"), ({"text_1": "sky " * 200}, "text_1"),
                            ({"text_2": ["sky " * 200]}, "text_2")):  # the part too long is named
            r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)

    _serve(EngineConfig(model=str(d)), llm.tokenizer, go, chat_template=SCORE_TEMPLATE)

    async def embedding_model(client, http):
        r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS, "instruction": "x"})
        assert r.status_code == 400 and "embeds each text on its own" in r.json()["error"]["message"], r.text

    _serve(EngineConfig(model=str(dirs["bert-cls"])), llm.tokenizer, embedding_model, chat_template=SCORE_TEMPLATE)

    async def untemplated(client, http):
        r = await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "instruction", r.text
        assert "--chat-template" in r.json()["error"]["message"]

    _serve(EngineConfig(model=str(d)), llm.tokenizer, untemplated)
    _assert_clean(llm)


@pytest.mark.parametrize("name", ["bert-3", "distil-2"])
def test_an_encoder_classifier_gives_hfs_softmax(dirs, name):
    want = torch.softmax(hf_encode(dirs[name], TEXTS), dim=-1)
    llm = LLM(str(dirs[name]))
    outs = llm.classify(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.probs for o in outs])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()
    _assert_clean(llm)


def test_nomic_bert_embeds_and_scores_as_hf_from_either_config(tmp_path):
    """NomicBERT (nomic-embed-text): rotary positions, SwiGLU, post-norm, token types; read from
    transformers' NomicBertConfig and from nomic's own (GPT-2 names), whose usable positions
    stop at max_trained_positions; a classifier's head reads [CLS] through BERT's pooler."""
    d = make_tiny_encoder(tmp_path / "native", "nomic_bert", pooling="mean_tokens")
    want = torch.nn.functional.normalize(hf_encode(d, TEXTS, "mean_tokens"), dim=-1)
    for folder, max_len in ((d, 128), (nomic_hub_format(d, tmp_path / "hub"), 96)):
        llm = LLM(str(folder), max_num_seqs=2)
        assert llm.engine.max_model_len == max_len
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        assert torch.allclose(got, want, atol=2e-6, rtol=0), (folder.name, (got - want).abs().max())
        _assert_clean(llm)
    ce = make_tiny_encoder(tmp_path / "ce", "nomic_bert", num_labels=1)
    want = torch.sigmoid(hf_encode(ce, [(QUERY, x) for x in DOCS])[:, 0])
    got = torch.tensor([o.outputs.score for o in LLM(str(ce)).score(QUERY, DOCS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)
    from engine.model.loader import load_arch

    hub = tmp_path / "hub" / "config.json"
    for change, words in (({"rotary_emb_interleaved": True}, "rotary_emb_interleaved=True"),
                          ({"prenorm": True}, "prenorm=True"),
                          ({"qkv_proj_bias": True}, "not all equal")):
        hub.write_text(json.dumps({**json.loads(hub.read_text()), **change}))
        with pytest.raises(ValueError, match=words):
            load_arch(hub.parent)
        hub.write_text(json.dumps({**json.loads(hub.read_text()), **{k: not v for k, v in change.items()}}))


def test_gte_embeds_and_scores_as_hf_from_either_config(tmp_path):
    """GTE (gte-base-en-v1.5, gte-multilingual): rotary positions under the hub's fixed NTK
    scaling, a GeGLU MLP with no bias on up and gate, post-norm, no token types where
    type_vocab_size is 0; read from transformers' GteConfig and from the hub's ("new"); a
    reranker's head reads [CLS] through its pooler."""
    from engine.model.loader import load_arch
    from engine.model.rope import rope_inv_freq

    factor, theta, head_dim = 2.0, 500.0, 16
    ntk = {"rope_type": "linear", "factor": factor ** (2 / head_dim), "rope_theta": theta * factor}  # the hub's NTK
    sharp = {"initializer_range": 0.2, "type_vocab_size": 0}  # attention far from uniform: positions matter
    d = make_tiny_encoder(tmp_path / "native", "gte", pooling="mean_tokens", rope_parameters=ntk, **sharp)
    want = torch.nn.functional.normalize(hf_encode(d, TEXTS, "mean_tokens"), dim=-1)
    unscaled = make_tiny_encoder(tmp_path / "unscaled", "gte", pooling="mean_tokens", **sharp,
                                 rope_parameters={"rope_type": "default", "rope_theta": theta})  # the same weights
    assert (torch.nn.functional.normalize(hf_encode(unscaled, TEXTS, "mean_tokens"), dim=-1) - want).abs().max() > 1e-4
    hub = gte_hub_format(d, tmp_path / "hub", ntk_factor=factor)
    arch = load_arch(hub)[0]  # the hub's NTK frequencies, as its code (and vLLM's) computes them
    base = theta * factor
    reference = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim)) / factor ** (2 / head_dim)
    assert torch.allclose(rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling), reference, rtol=1e-6)
    # gte-multilingual-base's form: a one-label token head of sparse weights, no id2label (an
    # embedding model); Snowflake's arctic-embed v2: model_type "gte" with the hub's fields
    sparse = gte_hub_format(d, tmp_path / "sparse", ntk_factor=factor, sparse_head=True)
    snowflake = gte_hub_format(d, tmp_path / "snowflake", ntk_factor=factor, model_type="gte")
    for folder in (d, hub, sparse, snowflake):
        llm = LLM(str(folder), max_num_seqs=2)
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        assert torch.allclose(got, want, atol=2e-6, rtol=0), (folder.name, (got - want).abs().max())
        _assert_clean(llm)
    ce = make_tiny_encoder(tmp_path / "ce", "gte", num_labels=1, type_vocab_size=1)
    want = torch.sigmoid(hf_encode(ce, [(QUERY, x) for x in DOCS])[:, 0])
    for folder in (ce, gte_hub_format(ce, tmp_path / "ce-hub")):
        got = torch.tensor([o.outputs.score for o in LLM(str(folder)).score(QUERY, DOCS, use_tqdm=False)])
        assert torch.allclose(got, want, atol=2e-6, rtol=0), (folder.name, got, want)
    hub = hub / "config.json"
    original = hub.read_text()
    for change, words in (({"logn_attention_scale": True}, "logn_attention_scale=True"),
                          ({"pack_qkv": False}, "pack_qkv=False"),
                          ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "mixed_b"),
                          ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'")):
        hub.write_text(json.dumps({**json.loads(original), **change}))
        with pytest.raises(ValueError, match=words):
            load_arch(hub.parent)
    hub.write_text(original)


@pytest.mark.parametrize("biases", [False, True])
def test_modernbert_embeds_and_scores_as_hf_its_local_layers_windowed(tmp_path, biases):
    """Rotary positions with a theta per layer kind, local layers reading 4 tokens each way (the
    tiny model's window: most prompts here cross it), a gated MLP, LayerNorms with or without
    biases; a cross-encoder head over CLS or the mean, as its config's classifier_pooling says."""
    extra = {"norm_bias": True, "attention_bias": True, "mlp_bias": True, "classifier_bias": True} if biases else {}
    pooling = "mean_tokens" if biases else "cls_token"
    d = make_tiny_encoder(tmp_path / "embed", "modernbert", pooling=pooling, **extra)
    want = torch.nn.functional.normalize(hf_encode(d, TEXTS, pooling), dim=-1)
    wide = make_tiny_encoder(tmp_path / "wide", "modernbert", pooling=pooling, local_attention=256, **extra)
    assert (torch.nn.functional.normalize(hf_encode(wide, TEXTS, pooling), dim=-1) - want).abs().max() > 1e-4
    llm = LLM(str(d), max_num_seqs=2, max_num_batched_tokens=128)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()
    _assert_clean(llm)
    ce = make_tiny_encoder(tmp_path / "ce", "modernbert", num_labels=1,
                           classifier_pooling="mean" if biases else "cls", **extra)
    want = torch.sigmoid(hf_encode(ce, [(QUERY, x) for x in DOCS])[:, 0])
    llm = LLM(str(ce))
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got, want)
    assert llm.engine.pooler.seq_pooling_type == ("MEAN" if biases else "CLS")
    _assert_clean(llm)
    if not biases:  # classifier_pooling is a classifier's: an embedding model without modules pools CLS, as vLLM's
        plain = make_tiny_encoder(tmp_path / "plain", "modernbert", classifier_pooling="mean")
        got = LLM(str(plain)).embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding
        assert torch.allclose(torch.tensor(got), torch.nn.functional.normalize(hf_encode(plain, TEXTS[:1]), dim=-1)[0],
                              atol=2e-6, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "distilbert", "nomic_bert", "modernbert", "gte"])
def test_a_token_classifier_gives_each_tokens_probabilities_as_hf(tmp_path, kind):
    """...ForTokenClassification (a named-entity tagger): vLLM's token_classify task, each token's
    softmax over the labels (its logits with use_activation false), many prompts a step."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    d = make_tiny_encoder(tmp_path / kind, kind, num_labels=5, per_token=True)
    tok, model = AutoTokenizer.from_pretrained(str(d)), AutoModelForTokenClassification.from_pretrained(str(d))
    with torch.no_grad():
        logits = [model.eval()(**tok(t, return_tensors="pt")).logits[0] for t in TEXTS]
    llm = LLM(str(d), max_num_seqs=2)
    assert llm.engine.pooler.tasks == ("token_classify",)
    for params, want, tol in ((None, [torch.softmax(x, dim=-1) for x in logits], 2e-6),
                              (PoolingParams(use_activation=False), logits, 2e-5)):  # logits up to ~10
        outs = llm.encode(TEXTS, pooling_params=params, pooling_task="token_classify", use_tqdm=False)
        for out, w in zip(outs, want):
            assert out.outputs.data.shape == w.shape and torch.allclose(out.outputs.data, w, atol=tol, rtol=0), (
                (out.outputs.data - w).abs().max())
    with pytest.raises(InvalidRequestError, match="Task classify is not supported by this model: it pools for "
                                                  "token_classify \\(it is a token classifier with 5 labels\\)"):
        llm.classify(TEXTS[:1], use_tqdm=False)
    _assert_clean(llm)
    if kind == "bert":  # no pooling type applies to it; dimensions are for embeddings
        assert LLM(str(d), pooler_config={"pooling_type": "MEAN"}).engine.pooler.tasks == ("token_classify",)
        with pytest.raises(ValueError, match="dimensions is for embeddings: a token classifier"):
            LLM(str(d), pooler_config={"dimensions": 4})
        with pytest.raises(ValueError, match="task 'embed' is not supported by this model: it is a token classifier"):
            LLM(str(d), pooler_config={"task": "embed"})


def test_http_pooling_of_a_token_classifier_equals_the_offline_call(tmp_path):
    import base64
    import struct

    from engine.config import EngineConfig

    d = make_tiny_encoder(tmp_path / "ner", "bert", num_labels=3, per_token=True)
    llm = LLM(str(d))
    want = [o.outputs.data.tolist() for o in llm.encode(TEXTS[:2], pooling_task="token_classify", use_tqdm=False)]

    async def go(client, http):
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[:2]})  # its task by default
        assert r.status_code == 200, r.text
        got = [x["data"] for x in r.json()["data"]]
        assert [len(g) for g in got] == [len(w) for w in want]
        assert torch.allclose(torch.tensor(got[0]), torch.tensor(want[0]), atol=1e-6, rtol=0)
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[1], "task": "token_classify",
                                              "encoding_format": "base64"})  # rows one after another
        raw = base64.b64decode(r.json()["data"][0]["data"])
        flat = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert torch.allclose(torch.tensor(flat), torch.tensor(want[1]).flatten(), atol=1e-6, rtol=0)
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[1], "encoding_format": "bytes"})
        assert json.loads(r.headers["metadata"])["data"][0]["shape"] == [len(want[1]), 3]  # tokens x labels
        assert r.content == raw
        for path, body, words in (("/classify", {"input": "x"}, "a token classifier with 3 labels, which pools for "
                                                                  "token_classify"),
                                  ("/pooling", {"input": "x", "task": "embed"}, "Task embed is not supported"),
                                  ("/v1/embeddings", {"input": "x"}, "token_classify"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                   "use /pooling")):
            r = await http.post(path, json={"model": "m", **body})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)

    _serve(EngineConfig(model=str(d)), llm.tokenizer, go)
    _assert_clean(llm)


def test_token_embed_gives_each_tokens_vector_offline_and_over_http(dirs):
    """vLLM's token_embed on an encoder: every token's final state, normalised, beside embed
    requests in the same steps; over /pooling as a list per token (base64: the rows one after
    another); a classifier does not pool for it."""
    import base64
    import struct

    from transformers import AutoModel, AutoTokenizer

    from engine.config import EngineConfig

    d = dirs["bert-cls"]
    tok, model = AutoTokenizer.from_pretrained(str(d)), AutoModel.from_pretrained(str(d)).eval()
    with torch.no_grad():
        want = [torch.nn.functional.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0], dim=-1)
                for t in TEXTS]
    llm = LLM(str(d), max_num_seqs=3)
    tasks = ["token_embed", "embed"] * 3
    outs = llm.encode(TEXTS, [PoolingParams(task=t) for t in tasks], use_tqdm=False)
    for out, w, task in zip(outs, want, tasks):
        if task == "embed":
            assert out.outputs.data.shape == (64,) and torch.allclose(out.outputs.data, w[0], atol=2e-6, rtol=0)
        else:
            assert out.outputs.data.shape == w.shape and torch.allclose(out.outputs.data, w, atol=2e-6, rtol=0)
    _assert_clean(llm)

    async def go(client, http):
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[:2], "task": "token_embed"})
        assert r.status_code == 200, r.text
        got = [torch.tensor(x["data"]) for x in r.json()["data"]]
        assert all(torch.allclose(g, w, atol=1e-6, rtol=0) for g, w in zip(got, want))
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[1], "task": "token_embed",
                                              "encoding_format": "base64"})
        raw = base64.b64decode(r.json()["data"][0]["data"])
        assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), want[1].flatten(), atol=1e-6,
                              rtol=0)
        r = await http.post("/pooling", json={"model": "m", "input": TEXTS[1]})  # the model's first task: embed
        assert torch.allclose(torch.tensor(r.json()["data"][0]["data"]), want[1][0], atol=1e-6, rtol=0)

    _serve(EngineConfig(model=str(d)), llm.tokenizer, go)
    with pytest.raises(InvalidRequestError, match="Task token_embed is not supported by this model"):
        LLM(str(dirs["bert-ce"])).encode(TEXTS[0], pooling_task="token_embed", use_tqdm=False)


def test_truncation_keeps_an_encoders_cls_and_sep(dirs):
    from transformers import AutoTokenizer

    d = dirs["bert-cls"]
    tok = AutoTokenizer.from_pretrained(str(d), truncation_side="right")  # vLLM's pooling runner's side
    text = TEXTS[5]
    llm = LLM(str(d))
    for keep in (2, 3, 8):
        out = llm.embed(text, truncate_prompt_tokens=keep, use_tqdm=False)[0]
        ids = tok(text, truncation=True, max_length=keep)["input_ids"]
        assert out.prompt_token_ids == ids and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
        want = torch.nn.functional.normalize(hf_encode(d, [tok.decode(ids[1:-1])]), dim=-1)[0]
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=2e-6, rtol=0)
    tok.truncation_side = "left"  # a request's truncation_side "left" keeps the text's end
    assert truncated(tok.encode(text), 8, 128, side="left", ends=framing_tokens(tok, llm.engine.pooler)) == tok(
        text, truncation=True, max_length=8)["input_ids"]
    unframed = llm.embed({"prompt_token_ids": [7, 8, 9, 10]}, truncate_prompt_tokens=2, use_tqdm=False)[0]
    assert unframed.prompt_token_ids == [7, 8]  # token ids without [CLS]...[SEP]: vLLM's first k
    with pytest.raises(InvalidRequestError, match="at least 2 tokens"):  # [CLS] or [SEP] alone is no prompt
        llm.embed(text, truncate_prompt_tokens=1, use_tqdm=False)
    _assert_clean(llm)


def test_a_sentence_transformers_max_seq_length_caps_max_model_len(dirs):
    """all-MiniLM's 256 of BERT's 512 positions: the length it was trained for, as vLLM caps it."""
    llm = LLM(str(dirs["bert-short"]))
    assert llm.engine.max_model_len == 16
    text = " ".join(["sky"] * 20)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed(text, use_tqdm=False)
    out = llm.embed(text, truncate_prompt_tokens=-1, use_tqdm=False)[0]  # -1: max_model_len of them, framed
    assert len(out.prompt_token_ids) == 16 and out.prompt_token_ids[0] == llm.tokenizer.cls_token_id
    with pytest.raises(ValueError, match="sentence-transformers max_seq_length"):
        LLM(str(dirs["bert-short"]), max_model_len=32)
    assert LLM(str(dirs["bert-short"]), max_model_len=8).engine.max_model_len == 8


@pytest.fixture(scope="module")
def lower_cased(tmp_path_factory):
    """An XLM-R sentence-transformers folder (a cased byte-level tokenizer) whose texts are
    lower-cased first, in sentence_xlm-roberta_config.json: the file of its model's kind."""
    d = make_tiny_encoder(tmp_path_factory.mktemp("lower"), "xlm-roberta", pooling="mean_tokens")
    (d / "sentence_xlm-roberta_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    return d


@pytest.fixture(scope="module")
def lower_cased_bert(tmp_path_factory):
    """A BERT folder saying do_lower_case: its tokenizer has a normalizer of its own (BertNormalizer)."""
    d = make_tiny_encoder(tmp_path_factory.mktemp("lower-bert"), "bert", pooling="cls_token")
    (d / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True}))
    return d


def test_a_do_lower_case_folder_embeds_its_texts_lower_cased(lower_cased):
    """sentence-transformers lower-cases a text before tokenizing it where the folder says
    do_lower_case, and so does vLLM: an upper-case text embeds as its lower-cased text."""
    from transformers import AutoTokenizer

    texts = ["The Capital OF France is PARIS", "WHO wrote THE Book"]
    cased = AutoTokenizer.from_pretrained(str(lower_cased))
    assert all(cased.encode(t) != cased.encode(t.lower()) for t in texts)  # the case matters to this vocabulary
    want = torch.nn.functional.normalize(hf_encode(lower_cased, [t.lower() for t in texts], "mean_tokens"), dim=-1)
    llm = LLM(str(lower_cased))
    assert llm.engine.max_model_len == 64  # max_seq_length read from the same file
    outs = llm.embed(texts, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()
    assert [o.prompt_token_ids for o in outs] == [cased.encode(t.lower()) for t in texts]
    _assert_clean(llm)


# capital and small sigmas (str.lower() makes a word-final capital one final), other cased and
# uncased letters, case-ignorable marks and punctuation, a dotted capital I, spaces
@given(st.text(alphabet="ΣσςΑαBbİ1 .'\u0301\u00ad\u02b0:Ⓐ<s>", max_size=24))
@settings(max_examples=300, deadline=None)
def test_the_lower_casing_tokenizer_encodes_any_text_as_its_str_lower(lower_cased, lower_cased_bert, text):
    from transformers import AutoTokenizer

    from engine.model_source import load_tokenizer

    for folder in (lower_cased, lower_cased_bert):  # no normalizer of its own; BERT's, after the new steps
        got = _tokenizers(folder, load_tokenizer).encode(text)
        assert got == _tokenizers(folder, AutoTokenizer.from_pretrained).encode(text.lower())


_loaded: dict = {}


def _tokenizers(path, load):
    """One tokenizer per (folder, loader) for the property test's examples."""
    key = (str(path), load)
    if key not in _loaded:
        _loaded[key] = load(str(path))
    return _loaded[key]


def test_mean_sqrt_len_pooling_is_taken_only_where_a_normalize_step_makes_it_means(tmp_path):
    normalized = make_tiny_encoder(tmp_path / "n", "bert", pooling="mean_sqrt_len_tokens")
    want = torch.nn.functional.normalize(hf_encode(normalized, TEXTS[:2], "mean_tokens"), dim=-1)
    got = torch.tensor([o.outputs.embedding for o in LLM(str(normalized)).embed(TEXTS[:2], use_tqdm=False)])
    assert torch.allclose(got, want, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="mean_sqrt_len_tokens without a Normalize step"):
        LLM(str(make_tiny_encoder(tmp_path / "raw", "bert", pooling="mean_sqrt_len_tokens", normalize=False)))


def test_what_an_encoder_cannot_do_is_refused_by_name(dirs):
    d = str(dirs["bert-cls"])
    for kwargs, words in (({"runner": "generate"}, "no language-model head"),
                          ({"pooler_config": {"pooling_type": "STEP"}}, "pooling type STEP is not supported for "
                                                                         "encoders"),
                          ({"enable_lora": True}, "LoRA adapters are not supported for encoder")):
        with pytest.raises(ValueError, match=words):
            LLM(d, **kwargs)
    with pytest.raises(ValueError, match="a sequence classifier scores its first token"):
        LLM(str(dirs["bert-ce"]), pooler_config={"pooling_type": "MEAN"})
    from engine.model.loader import load_arch

    with pytest.raises(ValueError, match="tensor_parallel_size 2 is not supported"):
        load_arch(d)[0].check_tp(2)
    small = LLM(d, max_num_batched_tokens=64)  # raised to max_model_len: a step holds a whole prompt
    assert small.engine.config.max_num_batched_tokens == small.engine.max_model_len == 128
    assert len(small.embed(" ".join(["sky"] * 100), use_tqdm=False)[0].prompt_token_ids) == 102
    llm = LLM(d)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed(" ".join(["sky"] * 200), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate|pooling"):
        llm.generate("the sky", use_tqdm=False)
    _assert_clean(llm)


@pytest.mark.parametrize("engine_cls", [None, "engine.process_engine:ProcessEngine"], ids=["async", "process"])
def test_http_embeddings_and_rerank_of_encoders_equal_the_offline_calls(dirs, engine_cls):
    from engine.config import EngineConfig

    embed = LLM(str(dirs["bert-cls"]))
    vectors = [o.outputs.embedding for o in embed.embed(TEXTS, use_tqdm=False)]
    cut = embed.embed(TEXTS[5], truncate_prompt_tokens=5, use_tqdm=False)[0].outputs.embedding
    empty = embed.embed("", use_tqdm=False)[0].outputs.embedding
    cross = LLM(str(dirs["bert-ce"]))
    scores = [o.outputs.score for o in cross.score(QUERY, DOCS, use_tqdm=False)]

    async def embeddings(client, http):
        r = await client.embeddings.create(model="m", input=TEXTS)
        assert torch.allclose(torch.tensor([d.embedding for d in r.data]), torch.tensor(vectors), atol=1e-6, rtol=0)
        assert r.usage.prompt_tokens == sum(len(embed.tokenizer.encode(t)) for t in TEXTS)
        r = await http.post("/v1/embeddings", json={"model": "m", "input": TEXTS[5], "truncate_prompt_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
        assert r.json()["data"][0]["embedding"] == pytest.approx(cut, abs=1e-6)
        ids = embed.tokenizer.encode(TEXTS[5])
        r = await http.post("/v1/embeddings", json={"model": "m", "input": TEXTS[5], "truncate_prompt_tokens": 5,
                                                    "truncation_side": "left", "use_activation": False})
        tail = embed.embed({"prompt_token_ids": ids[:1] + ids[-4:]}, use_tqdm=False)[0].outputs.embedding
        norm = sum(x * x for x in r.json()["data"][0]["embedding"]) ** 0.5
        assert [x / norm for x in r.json()["data"][0]["embedding"]] == pytest.approx(tail, abs=1e-6)
        r = await http.post("/v1/embeddings", json={"model": "m", "input": " ".join(["sky"] * 200)})
        assert r.status_code == 400 and "128" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/embeddings", json={"model": "m", "input": ["", TEXTS[0]]})  # [CLS] [SEP], as offline
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == pytest.approx(empty, abs=1e-6), r.text
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/embeddings", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"], r.text
        # Cohere's max_tokens_per_doc on an embedding model: the document's first tokens, framed
        r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": [DOCS[3]],
                                                "max_tokens_per_doc": 2})
        framed = embed.tokenizer(DOCS[3], truncation=True, max_length=4)["input_ids"]  # right side: its start
        query, doc = (torch.tensor(o.outputs.embedding) for o in embed.embed([QUERY, {"prompt_token_ids": framed}],
                                                                              use_tqdm=False))
        want = torch.nn.functional.cosine_similarity(query, doc, dim=0).item()
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-6), r.text
        r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS[2:3],
                                                "max_tokens_per_doc": 50})  # shorter already: whole
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            embed.tokenizer.encode(QUERY)) + len(embed.tokenizer.encode(DOCS[2])), r.text

    async def rerank(client, http):
        r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
        assert [x["index"] for x in r.json()["results"]] == best
        assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx([scores[i] for i in best],
                                                                                  abs=1e-6)
        for keep in (1, 3):  # fewer than [CLS], two [SEP] and a token of each text: the tokenizer would not cut
            r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS,
                                                    "truncate_prompt_tokens": keep})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
            assert "at least 5 tokens of a pair" in r.json()["error"]["message"]
        r = await http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS,
                                                "truncate_prompt_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5 * len(DOCS), r.text
        # a truncation_side: vLLM's cut of the whole pair's tokens on that side, here with [CLS] and [SEP] kept
        # each kept token with its token type (left: the document's end; right: the query's start)
        n = len(cross.tokenizer(QUERY, DOCS[0])["input_ids"])
        for side, kept in (("left", [0, *range(n - 5, n)]), ("right", [0, 1, 2, 3, 4, n - 1])):
            r = await http.post("/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS[0],
                                                "truncate_prompt_tokens": 6, "truncation_side": side})
            want = torch.sigmoid(hf_pair_logits(dirs["bert-ce"], [(QUERY, DOCS[0])], keep=kept)[0, 0]).item()
            assert r.json()["data"][0]["score"] != pytest.approx(scores[0], abs=1e-4)
            assert r.json()["data"][0]["score"] == pytest.approx(want, abs=1e-6), (side, r.text)
        long = " ".join(["sky"] * 200)  # past max_model_len (128): the field to blame is the one too long
        for query, docs, param in ((long, DOCS[:1], "query"), (QUERY, [long], "documents")):
            r = await http.post("/v1/rerank", json={"model": "m", "query": query, "documents": docs})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        odd = ("what [SEP] city", DOCS[0])  # a literal [SEP] in the query: the types start at the document
        r = await http.post("/v1/rerank", json={"model": "m", "query": odd[0], "documents": [odd[1]]})
        want = torch.sigmoid(hf_pair_logits(dirs["bert-ce"], [odd])[0, 0]).item()
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-6), r.text

    _serve(EngineConfig(model=str(dirs["bert-cls"])), embed.tokenizer, embeddings, engine_cls)
    _serve(EngineConfig(model=str(dirs["bert-ce"])), cross.tokenizer, rerank, engine_cls)
