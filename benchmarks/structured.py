"""What constrained decoding costs: offline tok/s with and without a grammar, same prompts.

The workload is benchmarks/offline.py's (seeded random prompt ids, a requested output length
per prompt, greedy, EOS ignored), run three ways in one process on one engine:

    none     no grammar
    any      every request constrained to the regex (?s:.*): a mask is computed and applied for
             every row of every step, yet (almost) nothing is masked, so the same tokens come out
             and the difference is the mask's cost alone
    json     every request constrained to a JSON schema (an array of at least four {"name",
             "value"} objects): a realistic grammar; its outputs end when the JSON does (or at
             their length), so compare tok/s, not seconds

It also times the parts of the mask path, per step: filling the bitmasks (llguidance, on the
engine's thread), applying them to the logits (in the sampler) and feeding the sampled tokens back
to the matchers. On a shared host these shares of a step say more than tok/s across runs.

    python benchmarks/structured.py
    python benchmarks/structured.py --num-prompts 16 --max-output 64 --threads 2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script or as a module

from benchmarks.common import machine_info, markdown_table, print_machine  # noqa: E402
from benchmarks.offline import make_workload  # noqa: E402

JSON_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "value": {"type": "integer"}},
    "required": ["name", "value"], "additionalProperties": False}, "minItems": 4}


class Timer:
    """Wraps a function and sums its wall time per call."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.real = owner, name, getattr(owner, name)
        self.seconds, self.calls = 0.0, 0

        def timed(*args, **kwargs):
            start = perf_counter()
            try:
                return self.real(*args, **kwargs)
            finally:
                self.seconds += perf_counter() - start
                self.calls += 1
        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.real)


def run(llm, work, spec, label: str) -> dict:
    from engine import SamplingParams
    from engine import sampler as sampler_module
    from engine.structured import matchers

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, structured_outputs=spec)
              for m in work.output_lens]
    if spec is not None:  # compile outside the timed run, as AsyncEngine does ahead of a request
        llm.engine.structured.compiler.compile(spec)
    fill = Timer(matchers.GrammarMatchers, "mask")
    accept = Timer(matchers.GrammarMatchers, "accept")
    apply = Timer(sampler_module, "apply_grammar_mask")
    steps = Timer(llm.engine, "step")
    start = perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    seconds = perf_counter() - start
    for t in (fill, accept, apply, steps):
        t.restore()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"run": label, "tokens": tokens, "seconds": round(seconds, 2), "tok/s": round(tokens / seconds, 1),
            "steps": steps.calls, "step ms": round(1e3 * steps.seconds / max(1, steps.calls), 1),
            "fill ms/step": round(1e3 * fill.seconds / max(1, steps.calls), 2),
            "apply ms/step": round(1e3 * apply.seconds / max(1, steps.calls), 2),
            "accept ms/step": round(1e3 * accept.seconds / max(1, steps.calls), 2),
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", default=None)
    p.add_argument("--rounds", type=int, default=2, help="each run this many times, interleaved; the best counts")
    args = p.parse_args(argv)
    if not (1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output):
        p.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")

    import torch

    from engine import LLM
    from engine.structured import StructuredOutputsParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, device=args.device or "auto")
    vocab = llm.engine.executor.info.vocab_size
    work = make_workload(args.num_prompts, (args.min_input, args.max_input), (args.min_output, args.max_output),
                         args.seed, vocab)
    warm = make_workload(4, (8, 16), (4, 8), args.seed + 1, vocab)
    specs = {"none": None, "any": StructuredOutputsParams(regex=r"(?s:.*)"),
             "json": StructuredOutputsParams(json=JSON_SCHEMA)}
    for spec in specs.values():
        run(llm, warm, spec, "warm-up")
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, spec in specs.items():
            r = run(llm, work, spec, label)
            if label not in best or r["tok/s"] > best[label]["tok/s"]:
                best[label] = r
    print_machine(machine_info())
    same = sum(a == b for a, b in zip(best["none"]["outputs"], best["any"]["outputs"]))
    headers = ["run", "tokens", "seconds", "tok/s", "vs none", "steps", "step ms", "fill ms/step",
               "apply ms/step", "accept ms/step"]
    rows = [[r["run"], r["tokens"], r["seconds"], r["tok/s"], f"{r['tok/s'] / best['none']['tok/s']:.2f}x",
             r["steps"], r["step ms"], r["fill ms/step"], r["apply ms/step"], r["accept ms/step"]]
            for r in best.values()]
    print(markdown_table(headers, rows))
    print(f"\n'any' outputs equal to 'none': {same}/{len(work.prompts)} prompts")


if __name__ == "__main__":
    main()
