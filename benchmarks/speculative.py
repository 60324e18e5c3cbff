"""Speculative decoding by n-gram prompt lookup: kvserve with and without drafts, and vLLM's CPU
build with and without the same speculative_config, side by side on one machine.

    python benchmarks/speculative.py                       # kvserve, and vLLM where its venv is
    python benchmarks/speculative.py --k 2,4 --systems kvserve

The workload is what n-gram lookup is for: chat requests that repeat much of their prompt (edit
this code, print it again), greedy, one request at a time (the latency a user sees) and all at once.
Every kvserve run must give the same tokens with and without drafts. vLLM runs in its own venv
(benchmarks/vllm_cpu.py install), one process per configuration.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_cpu import DEFAULT_VENV, GPU_MEMORY_UTILIZATION, venv_bin  # noqa: E402

CODE = '''def fibonacci(n):
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''
PROSE = ("The KV cache stores the keys and values of every token a sequence has seen, so that each new "
         "token attends to them without computing them again. Paged attention splits the cache into "
         "fixed-size blocks, so that sequences of any length share one pool of memory without waste.")
TASKS = [f"Rename the function factorial to fact in this code and print the whole code again:\n\n{CODE}",
         f"Add a one-line docstring to each function and print the whole code again:\n\n{CODE}",
         f"Repeat this paragraph exactly, then say how many sentences it has:\n\n{PROSE}",
         f"Replace the word 'cache' with 'store' in this paragraph and print it again:\n\n{PROSE}"]

VLLM_SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    model, spec, max_tokens, tasks = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=model, speculative_config=spec or None, max_model_len=2048, gpu_memory_utilization=%s,
              max_num_seqs=16, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": t}] for t in tasks]
    llm.chat(chats[:1], params, use_tqdm=False)
    t = time.perf_counter()
    one = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.chat(chats, params, use_tqdm=False)
    t2 = time.perf_counter() - t
    print("RESULT " + json.dumps({"tokens": [list(o) for o in one], "one_s": t1, "all_s": t2}))

if __name__ == "__main__":
    main()
''' % GPU_MEMORY_UTILIZATION


def ngram(k: int, lookup_max: int, lookup_min: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min} if k else {}


def run_kvserve(model: str, spec: dict, max_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec or None, max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": t}] for t in TASKS]
    llm.chat(chats[:1], params, use_tqdm=False)
    t = time.perf_counter()
    one = [list(llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids) for c in chats]
    one_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.chat(chats, params, use_tqdm=False)
    all_s = time.perf_counter() - t
    st = llm.engine.scheduler.stats
    return {"tokens": one, "one_s": one_s, "all_s": all_s, "drafts": st.spec_draft_tokens,
            "accepted": st.spec_accepted_tokens}


def run_vllm(venv: Path, model: str, spec: dict, max_tokens: int) -> dict:
    out = subprocess.run([str(venv_bin(venv, "python")), "-c", VLLM_SCRIPT, model, json.dumps(spec), str(max_tokens),
                          json.dumps(TASKS)], capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--systems", default="kvserve,vllm")
    p.add_argument("--k", default="3", help="num_speculative_tokens to try, comma list")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    from engine.model_source import resolve_model

    model = args.model or str(resolve_model(None))
    systems = args.systems.split(",")
    if "vllm" in systems and not venv_bin(args.vllm_venv, "python").exists():
        print(f"no vLLM venv at {args.vllm_venv} (benchmarks/vllm_cpu.py install): kvserve only")
        systems.remove("vllm")
    ks = [0] + [int(k) for k in args.k.split(",")]
    rows = []
    for system in systems:
        base = None
        for k in ks:
            spec = ngram(k, args.prompt_lookup_max, args.prompt_lookup_min)
            print(f"{system} k={k} ...", flush=True)
            r = run_kvserve(model, spec, args.max_tokens) if system == "kvserve" else \
                run_vllm(args.vllm_venv, model, spec, args.max_tokens)
            n = sum(len(t) for t in r["tokens"])
            r.update(system=system, k=k, output_tokens=n, one_tok_s=n / r["one_s"], all_tok_s=n / r["all_s"])
            if base is None:
                base = r
            r["same_tokens"] = r["tokens"] == base["tokens"]
            if system == "kvserve" and not r["same_tokens"]:
                raise SystemExit(f"kvserve k={k}: greedy tokens differ from k=0")
            rows.append(r)
    print(f"\n{'system':8} {'k':>2} {'tokens':>6} {'1-at-a-time tok/s':>18} {'all-at-once tok/s':>18} "
          f"{'accepted/drafted':>17} {'same tokens':>11}")
    for r in rows:
        acc = f"{r['accepted']}/{r['drafts']}" if "drafts" in r else "-"
        print(f"{r['system']:8} {r['k']:>2} {r['output_tokens']:>6} {r['one_tok_s']:>18.1f} {r['all_tok_s']:>18.1f} "
              f"{acc:>17} {str(r['same_tokens']):>11}")
    for r in rows:
        peer = next((x for x in rows if x["system"] == "vllm" and x["k"] == r["k"]), None)
        if r["system"] == "kvserve" and peer:
            print(f"k={r['k']}: kvserve / vLLM  one at a time {r['one_tok_s'] / peer['one_tok_s']:.2f}x, "
                  f"all at once {r['all_tok_s'] / peer['all_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
