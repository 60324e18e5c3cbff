"""/v1/completions with echo, prompt logprobs and logit_bias, through the official `openai` client
against a real Ray + Serve serving SmolLM2, whose prefills are chunked (a 32-token step budget);
and one lm-evaluation-harness run of its `local-completions` model, scored against lm-eval's `hf`
model on the same weights.

Echoed prompt logprobs must equal HF's log_softmax over the same prompt within 1e-4 (fp32).
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.local_serve import running_server

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
BUDGET = 32  # max_num_batched_tokens: the long prompt's prefill takes three or more steps
TOL = 1e-4
SHORT = "The capital of France is"
LONG = ("A paged KV cache stores the keys and values of every token in fixed-size blocks, so that "
        "sequences of different lengths can share one pool of memory without fragmentation, and a "
        "scheduler can admit new requests whenever enough blocks are free. When the pool runs dry, "
        "the newest running sequence is preempted: its blocks return to the pool and it waits at the "
        "front of the queue, to be recomputed from its prompt and the tokens it has produced so far.")
CHAT = "What is the capital of France?"
REPO = Path(__file__).resolve().parent.parent
TASK = "kvserve_tiny_mc"  # tests/data/tiny_mc.yaml


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    """HF's log_softmax over each prompt, and the offline engine's greedy completions, before the
    server starts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = {p: tok.encode(p, add_special_tokens=False) for p in (SHORT, LONG)}
    ids[CHAT] = tok.encode(tok.apply_chat_template(_messages(CHAT), tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)  # as the server renders a chat
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = {p: model(torch.tensor([i])).logits[0, :-1].float().log_softmax(-1) for p, i in ids.items()}
    del model
    llm = LLM(model=smollm2_path, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)
    greedy = llm.generate([SHORT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    return {"tok": tok, "ids": ids, "ref": ref, "greedy": greedy}


@pytest.fixture(scope="module")
def hf_lm_eval(smollm2_path):
    """lm-eval's own `hf` model on the task, before the server starts (the two would share 2 cores);
    None without lm-eval (the test extras have it)."""
    try:
        import lm_eval
    except ImportError:
        return None
    return _lm_eval(lm_eval, "hf", f"pretrained={smollm2_path},dtype=float32,device=cpu", batch_size=8)


@pytest.fixture(scope="module")
def server(oracle, hf_lm_eval):
    args = dict(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=256, max_num_seqs=16,
                max_num_batched_tokens=BUDGET)
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _assert_echo_logprobs(lps, ids: list[int], ref: torch.Tensor, tok) -> None:
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    got = torch.tensor(lps.token_logprobs[1:len(ids)])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() < TOL
    for top, row in zip(lps.top_logprobs[1:len(ids)], ref):  # logprobs=1: the most likely token
        assert max(top.values()) == pytest.approx(row.max().item(), abs=TOL)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "chunked"])
def test_echo_logprobs_with_max_tokens_0_equal_hf(client, oracle, prompt):
    """lm-evaluation-harness's loglikelihood request: the reply is the prompt and its logprobs."""
    ids = oracle["ids"][prompt]
    assert prompt != SHORT or len(ids) < BUDGET
    assert prompt != LONG or len(ids) > 2 * BUDGET
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    _assert_echo_logprobs(c.logprobs, ids, oracle["ref"][prompt], oracle["tok"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert by_ids.choices[0].text == prompt and by_ids.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs


def test_echo_then_greedy_completion(client, oracle):
    ids, greedy = oracle["ids"][SHORT], oracle["greedy"]
    r = client.completions.create(model=MODEL, prompt=SHORT, echo=True, logprobs=2, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == SHORT + greedy.text
    assert len(c.logprobs.tokens) == len(ids) + 8 and r.usage.completion_tokens == 8
    _assert_echo_logprobs(c.logprobs, ids, oracle["ref"][SHORT], oracle["tok"])
    assert c.logprobs.text_offset[len(ids)] == sum(len(t) for t in c.logprobs.tokens[:len(ids)])
    for token, top in zip(c.logprobs.tokens[1:], c.logprobs.top_logprobs[1:]):
        assert token in top and len(top) <= 3  # the 2 most likely, and the token when not among them
    plain = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=8, temperature=0, echo=False,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == greedy.text


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assert_prompt_logprobs(scored: list, ids: list[int], ref: torch.Tensor, tok, k: int) -> None:
    """vLLM's prompt_logprobs (null, then token id -> logprob, rank, decoded_token) against HF."""
    assert len(scored) == len(ids) and scored[0] is None
    for p, (entry, tid) in enumerate(zip(scored[1:], ids[1:])):
        row = ref[p]
        assert str(tid) in entry and len(entry) <= k + 1
        mine = entry[str(tid)]
        assert abs(mine["logprob"] - row[tid].item()) < TOL and mine["decoded_token"] == tok.decode([tid])
        assert int((row > row[tid] + TOL).sum()) + 1 <= mine["rank"] <= int((row >= row[tid] - TOL).sum())
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert top[0]["logprob"] == pytest.approx(row.max().item(), abs=TOL)


def test_vllm_prompt_logprobs_extra(client, oracle):
    ids, ref, tok = oracle["ids"][LONG], oracle["ref"][LONG], oracle["tok"]
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    c = r.choices[0]
    assert c.logprobs is None and not c.text.startswith(LONG)
    _assert_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, ref, tok, 2)
    only = client.completions.create(model=MODEL, prompt=LONG, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert only.choices[0].text == "" and [e and len(e) for e in only.choices[0].model_extra["prompt_logprobs"]] \
        == [None] + [1] * (len(ids) - 1)


def test_a_reply_over_grpcs_default_4_mib_arrives_whole(server, oracle):
    """Serve's gRPC transport (cluster/serve_env.py) caps a replica's messages at 4 MiB unless told
    otherwise: lm-eval-style scoring of a few long prompts with 20 logprobs each way replies ~7 MB,
    which was a bare 500 once the work was done."""
    prompt = oracle["ids"][LONG] * 5  # ~430 tokens
    r = httpx.post(f"{server}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": [prompt] * 6, "max_tokens": 1, "echo": True, "logprobs": 20,
        "prompt_logprobs": 20, "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    assert len(r.content) > 5 << 20
    choices = r.json()["choices"]
    assert len(choices) == 6 and all(len(c["prompt_logprobs"]) == len(prompt) for c in choices)
    assert all(len(c["logprobs"]["tokens"]) == len(prompt) + 1 for c in choices)


def test_chat_prompt_logprobs_and_echo(client, oracle):
    """vLLM's chat extras: the rendered prompt's logprobs on the reply, against HF's; and echo, the
    last message's text before a reply that goes on with it (continue_final_message)."""
    ids, ref, tok = oracle["ids"][CHAT], oracle["ref"][CHAT], oracle["tok"]
    r = client.chat.completions.create(model=MODEL, messages=_messages(CHAT), max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    assert r.usage.prompt_tokens == len(ids)
    _assert_prompt_logprobs(r.model_extra["prompt_logprobs"], ids, ref, tok, 1)
    started = _messages(CHAT) + [{"role": "assistant", "content": "The capital of France"}]
    kwargs = dict(model=MODEL, messages=started, max_tokens=4, temperature=0,
                  extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    kwargs["extra_body"]["echo"] = True
    echoed = client.chat.completions.create(**kwargs).choices[0].message
    assert echoed.role == "assistant" and echoed.content == "The capital of France" + plain and plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == echoed.content


def test_streamed_echo_equals_the_reply(client):
    kwargs = dict(model=MODEL, prompt=[SHORT, LONG], echo=True, logprobs=0, max_tokens=3, temperature=0)
    whole = client.completions.create(**kwargs)
    texts, tokens = {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert texts == {c.index: c.text for c in whole.choices}
    # The same tokens; their logprobs to float32 noise (the two runs batch the rows differently, and
    # a matmul's summation order follows the batch shape).
    assert tokens.keys() == {c.index for c in whole.choices}
    for c in whole.choices:
        assert [x is None for x in tokens[c.index]] == [x is None for x in c.logprobs.token_logprobs]
        assert [x for x in tokens[c.index] if x is not None] \
            == pytest.approx([x for x in c.logprobs.token_logprobs if x is not None], abs=1e-3)
    assert texts[0].startswith(SHORT) and texts[1].startswith(LONG)
    only = list(client.completions.create(stream=True, **{**kwargs, "max_tokens": 0}))
    assert "".join(c.choices[0].text for c in only if c.choices and c.choices[0].index == 0) == SHORT


def test_logit_bias(client, oracle):
    tok, greedy = oracle["tok"], oracle["greedy"]
    target = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == tok.decode([target] * 3)
    # Past OpenAI's [-100, 100]: taken at its ends, as vLLM's server takes them (the engine,
    # which refuses them, sees 100: not a 400)
    past = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3, temperature=0,
                                     logit_bias={str(target): 1e6})
    assert past.choices[0].text == r.choices[0].text
    banned = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=1, temperature=0,
                                       logit_bias={str(greedy.token_ids[0]): -101})
    assert banned.choices[0].text != tok.decode(greedy.token_ids[:1])


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # beyond the vocabulary: the engine's check
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo or prompt_logprobs
])
def test_bad_values_are_400s(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


# -- lm-evaluation-harness -----------------------------------------------------------------------------

def _lm_eval(lm_eval, model: str, model_args: str, **kwargs) -> dict:
    """One offline lm-eval run of the local task: {"acc": ..., "loglikelihoods": per doc, per choice}."""
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.chdir(REPO)  # the task's data_files path is relative to the repository
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                          task_manager=TaskManager(include_path=str(REPO / "tests" / "data")),
                                          **kwargs)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return {"acc": results["results"][TASK]["acc,none"],
            "loglikelihoods": [[r[0] for r in s["filtered_resps"]] for s in samples]}


def test_lm_eval_local_completions_equals_hf(server, smollm2_path, hf_lm_eval):
    if hf_lm_eval is None:
        pytest.skip("lm-eval is not installed: pip install 'lm-eval[api]'")
    import lm_eval

    args = (f"model={MODEL},base_url={server}/v1/completions,tokenizer={smollm2_path},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,batch_size=8")
    ours = _lm_eval(lm_eval, "local-completions", args)
    print(json.dumps({"local-completions acc": ours["acc"], "hf acc": hf_lm_eval["acc"]}))
    assert len(ours["loglikelihoods"]) == 40
    assert ours["acc"] == hf_lm_eval["acc"] > 0.25  # better than chance on 4 choices
    got, want = torch.tensor(ours["loglikelihoods"]), torch.tensor(hf_lm_eval["loglikelihoods"])
    assert (got - want).abs().max().item() < 1e-3  # sums of a few tokens' logprobs, each within ~1e-5
