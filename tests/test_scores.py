"""Scores on an embedding model (engine.scoring, router.scores; vLLM's score and rerank APIs):
a pair scores the cosine similarity of its two inputs' embeddings, as HF transformers' base model
computes them; `LLM.score`, POST /score and POST /rerank give the same numbers, pair inputs 1:N or
N:N, order and cut documents as Jina's and Cohere's clients expect, and refuse what does not pair
up, saying why; every request's KV blocks come back."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM
from engine.scoring import pair_scores, score_pairs
from tests.test_embeddings import VOCAB, _assert_clean, _serve, hf_last_hidden
from tests.tiny_llama import make_tiny_llama

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Bananas are yellow.", "Paris", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path):
    return make_tiny_llama(tmp_path_factory.mktemp("qwen3"), smollm2_path, "qwen3", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), runner="pooling", num_gpu_blocks_override=24)


def _hf_cosines(model_dir, tokenizer, firsts: list[str], seconds: list[str]) -> list[float]:
    vectors = hf_last_hidden(model_dir, [tokenizer.encode(t) for t in firsts + seconds])
    a, b = vectors[:len(firsts)], vectors[len(firsts):]
    return [torch.nn.functional.cosine_similarity(a[i], b[j], dim=0).item()
            for i, j in score_pairs(len(a), len(b))]


def test_pairs_pair_up_as_vllms_and_cosine_is_the_angles():
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(3, 3) == [(0, 0), (1, 1), (2, 2)]
    assert score_pairs(1, 1) == [(0, 0)]
    for counts, words in (((2, 3), "1:1, 1:N or N:N"), ((0, 2), "one text element"), ((1, 0), "text_pair")):
        with pytest.raises(ValueError, match=words):
            score_pairs(*counts)
    assert pair_scores([[1.0, 0.0]], [[0.0, 2.0], [3.0, 0.0], [0.0, 0.0]]) == [0.0, 1.0, 0.0]  # 1:N; a zero vector: 0
    got = pair_scores([[3.0, 4.0], [1.0, 1.0]], [[6.0, 8.0], [-1.0, 0.0]])  # N:N
    assert got == pytest.approx([1.0, -1 / math.sqrt(2)], abs=1e-15)
    with pytest.raises(ValueError, match="2 and 3 dimensions"):
        pair_scores([[1.0, 0.0]], [[1.0, 0.0, 0.0]])


def test_llm_score_is_the_cosine_of_hfs_embeddings(model_dir, llm):
    want = _hf_cosines(model_dir, llm.tokenizer, [QUERY], DOCS)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)
    q = llm.tokenizer.encode(QUERY)
    assert outs[1].prompt_token_ids == q + llm.tokenizer.encode(DOCS[1])
    pairwise = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)  # N:N, the i-th with the i-th
    assert [o.outputs.score for o in pairwise] == pytest.approx(_hf_cosines(model_dir, llm.tokenizer, DOCS[:2],
                                                                            DOCS[2:]), abs=1e-5)
    assert [o.outputs.score for o in llm.score([QUERY], tuple(DOCS), use_tqdm=False)] == pytest.approx(want, abs=1e-5)
    cut = llm.score(QUERY, DOCS[3], truncate_prompt_tokens=4, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 8  # each input keeps its first 4 tokens
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(DOCS[:2], DOCS[1:], use_tqdm=False)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.score(QUERY, DOCS, chat_template="{{ x }}", use_tqdm=False)
    _assert_clean(llm)


def test_a_generating_engine_refuses_to_score(model_dir):
    generating = LLM(str(model_dir), num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.score(QUERY, DOCS[0], use_tqdm=False)
    _assert_clean(generating)


def test_score_and_rerank_over_http_equal_llm_score(model_dir, llm):
    from engine.config import EngineConfig

    want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want_pairs = [o.outputs.score for o in llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)]
    ntok = len(llm.tokenizer.encode(QUERY)) + sum(len(llm.tokenizer.encode(d)) for d in DOCS)
    best_first = sorted(range(len(DOCS)), key=lambda i: -want[i])

    async def go(client, http):
        for path, names in (("/score", ("text_1", "text_2")), ("/v1/score", ("queries", "documents")),
                            ("/score", ("queries", "items")), ("/score", ("data_1", "data_2"))):
            r = await http.post(path, json={"model": "m", names[0]: QUERY, names[1]: DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("score-")
            assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
            assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
            assert body["usage"]["prompt_tokens"] == ntok  # the query is embedded once
        r = await http.post("/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]})
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want_pairs, abs=1e-6)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = await http.post(path, json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 3})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] == ntok
            assert [x["index"] for x in body["results"]] == best_first[:3]
            assert [x["relevance_score"] for x in body["results"]] == pytest.approx([want[i] for i in best_first[:3]],
                                                                                    abs=1e-6)
            assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in best_first[:3]]
        r = await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": False,
                                             "request_id": "mine"})
        assert [x["index"] for x in r.json()["results"]] == best_first  # top_n 0: all of them
        assert all("document" not in x for x in r.json()["results"]) and r.json()["id"] == "rerank-mine"
        many = [f"document {i}" for i in range(300)]  # past 256 (generation's bound): embeddings take OpenAI's 2,048
        r = await http.post("/rerank", json={"query": QUERY, "documents": many, "top_n": 2})
        assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        # Jina's and Cohere's forms: {"text": ...} documents, a null top_n (LangChain), max_tokens_per_doc
        # (a document object's other fields come back with it, as Cohere keeps them)
        objects = [{"text": d} | ({"id": i, "meta": {"title": "t"}} if i % 2 else {}) for i, d in enumerate(DOCS)]
        r = await http.post("/v1/rerank", json={"query": QUERY, "documents": objects, "top_n": None,
                                                "return_documents": None})
        assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx(sorted(want, reverse=True), abs=1e-6)
        assert [x["document"] for x in r.json()["results"]] == [objects[i] for i in best_first]
        r = await http.post("/rerank", json={"query": QUERY, "documents": objects[1]})  # one document, not a list
        assert r.json()["results"] == [{"index": 0, "relevance_score": pytest.approx(want[1], abs=1e-6),
                                        "document": objects[1]}], r.text
        first_two = [llm.tokenizer.encode(d)[:2] for d in DOCS]
        cut = [o.outputs.score for o in llm.score(QUERY, first_two, use_tqdm=False)]
        r = await http.post("/v2/rerank", json={"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 2})
        assert sorted((x["index"], x["relevance_score"]) for x in r.json()["results"]) == [
            (i, pytest.approx(s, abs=1e-6)) for i, s in enumerate(cut)]
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(QUERY)) + sum(map(len, first_two))
        # vLLM's max_tokens_per_query (on /score too); 0 or null: whole, vLLM's default
        query_two = llm.tokenizer.encode(QUERY)[:2]
        r = await http.post("/score", json={"text_1": QUERY, "text_2": DOCS, "max_tokens_per_query": 2,
                                            "max_tokens_per_doc": 0})
        assert [x["score"] for x in r.json()["data"]] == pytest.approx(
            [o.outputs.score for o in llm.score({"prompt_token_ids": query_two}, DOCS, use_tqdm=False)], abs=1e-6)
        r = await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "max_tokens_per_doc": None,
                                             "max_tokens_per_query": 0})
        assert sorted(x["relevance_score"] for x in r.json()["results"]) == pytest.approx(sorted(want), abs=1e-6)
        r = await http.post("/score", json={"text_1": QUERY, "text_2": "x " * 20, "truncate_prompt_tokens": 4})
        assert r.json()["usage"]["prompt_tokens"] == 8
        refused = {}
        for name, path, body in (
                ("mismatch", "/score", {"text_1": DOCS[:2], "text_2": DOCS[1:]}),
                ("empty", "/score", {"text_1": [], "text_2": DOCS}),
                ("no items", "/score", {"queries": QUERY, "items": []}),
                ("empty text", "/rerank", {"query": "", "documents": DOCS}),
                ("no documents", "/rerank", {"query": QUERY, "documents": []}),
                ("two pairs", "/score", {"text_1": QUERY, "text_2": DOCS, "queries": QUERY, "documents": DOCS}),
                ("half a pair", "/score", {"queries": QUERY, "text_2": DOCS}),
                ("multimodal", "/score", {"text_1": QUERY, "text_2": {"content": [{"type": "image_url"}]}}),
                ("many", "/rerank", {"query": QUERY, "documents": ["x"] * 2049}),
                ("stray name", "/score", {"text_1": QUERY, "text_2": DOCS, "queries": "x"}),
                ("long second", "/score", {"data_1": QUERY, "data_2": [DOCS[0], "x " * 300]}),
                ("long query", "/rerank", {"query": "x " * 300, "documents": DOCS}),
                ("keep none", "/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0}),
                ("negative cut", "/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": -1}),
                ("a bad document", "/rerank", {"query": QUERY, "documents": [{"title": "b"}]}),
                ("an empty document", "/rerank", {"query": QUERY, "documents": ["a", {"text": "", "id": 1}]}),
                ("long", "/rerank", {"query": QUERY, "documents": ["x " * 300]}),
                ("normalize", "/score", {"text_1": QUERY, "text_2": DOCS, "normalize": True}),
                ("model", "/score", {"model": "other", "text_1": QUERY, "text_2": DOCS})):
            r = await http.post(path, json=body)
            refused[name] = (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"])
        r = await http.get("/openapi.json")
        paths = r.json()["paths"]
        assert all(p in paths for p in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"))
        return refused, [r.json() for r in [await http.post(path, json=body) for path, body in (
            ("/rerank", {"query": QUERY, "documents": ["x"] * 2048}), )]]

    refused, (full,) = _serve(EngineConfig(model=str(model_dir), runner="pooling", max_model_len=256,
                                  num_gpu_blocks_override=48), llm.tokenizer, go)
    assert {k: s for k, (s, _, _) in refused.items()} == {k: 404 if k == "model" else 400 for k in refused}, refused
    assert "1:1, 1:N or N:N" in refused["mismatch"][1] and refused["mismatch"][2] == "text_2"
    assert "At least one text element" in refused["empty"][1] and refused["empty"][2] == "text_1"
    assert "text_pair" in refused["no documents"][1] and refused["no documents"][2] == "documents"
    assert "give one pair of inputs" in refused["two pairs"][1] and "give one pair" in refused["half a pair"][1]
    assert "2049 inputs" in refused["many"][1] and len(full["results"]) == 2048  # OpenAI's 2,048 documents
    assert "give one pair" in refused["stray name"][1]
    assert refused["no items"][1].startswith("items: At least one text_pair") and refused["no items"][2] == "items"
    assert refused["long second"][2] == "data_2" and refused["long query"][2] == "query"
    assert "must be >= 1, or -1, got 0" in refused["keep none"][1]
    assert "maximum context length is 256 tokens" in refused["long"][1]
    assert "use_activation" in refused["normalize"][1]
    assert refused["a bad document"][1:] == ("documents.0.text: Field required", "documents.0.text")
    assert refused["empty text"][1:] == ("the prompt is empty", "query")
    assert refused["an empty document"][1:] == ("the prompt is empty (input 1)", "documents")  # tokenizes to nothing


def test_the_flag_bounds_inputs_and_sequences_alike():
    from router.settings import RouterSettings

    default, given = RouterSettings(served_model_name="m"), RouterSettings(served_model_name="m",
                                                                             max_sequences_per_request=8)
    assert (default.sequence_limit(), default.sequence_limit(pooling=True)) == (256, 2048)
    assert (given.sequence_limit(), given.sequence_limit(pooling=True)) == (8, 8)
    with pytest.raises(ValueError, match="must be >= 1"):
        RouterSettings(served_model_name="m", max_sequences_per_request=0)


def test_a_generating_server_says_how_to_serve_scores(model_dir, tokenizer):
    from engine.config import EngineConfig

    async def go(client, http):
        return [(await http.post(path, json=body)) for path, body in
                (("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                 ("/pooling", {"input": "a"}))]

    replies = _serve(EngineConfig(model=str(model_dir), max_model_len=128, num_gpu_blocks_override=24), tokenizer, go)
    assert [r.status_code for r in replies] == [400, 400, 400]
    assert "Score API" in replies[0].json()["error"]["message"] and "Pooling API" in replies[2].json()["error"]["message"]
    assert all("--runner pooling" in r.json()["error"]["message"] for r in replies)
