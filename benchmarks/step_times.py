"""Engine step times: a decode step at several batch sizes, and prefill throughput, with CUDA
graphs and with --enforce-eager, on one model.

    decode   B requests with --context-token prompts are prefilled, then --steps decode-only steps
             are timed one by one (engine.step(), sampling and its device-to-host copy included);
             the median is reported, and B / median as output tok/s; "host" is the median of the
             step's time outside the model's step (executor.execute, timed to the device's end, in
             --steps more steps), the engine's Python: schedule, step inputs, sampling rows, tokens,
             outputs
    prefill  --prefill-prompts prompts of --prefill-len tokens, one output token each, in steps of
             --max-num-batched-tokens; prompt tokens / seconds

    python benchmarks/step_times.py --random-weights smollm2-135m --batches 1,64,256 --json out.json

--profile PATH also records 5 decode steps at the largest batch with torch.profiler (first mode
only: CUDA graphs by default, the figures the targets are about, taken first so that a run cut
short has them) and writes the top kernels and host functions there: where a step's time goes. With more
than one mode, each runs in a process of its own: it starts with the whole device, whatever the
mode before it left behind (a KV pool still referenced, the profiler's hooks), and one that fails
leaves the others' figures.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import gc
import io
import json
import multiprocessing
import pstats
import random
import statistics
import sys
import traceback
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script or as a module

from benchmarks.common import machine_info, markdown_table  # noqa: E402


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def decode_step_ms(llm, batch: int, context: int, steps: int, rng: random.Random,
                   profile: str | None = None) -> tuple[float, float]:
    """-> (median step ms, median host ms of a step)."""
    import torch

    from engine import SamplingParams

    eng, vocab = llm.engine, llm.engine.executor.info.vocab_size
    # Enough tokens that every request still decodes in the last timed (and profiled) step: the
    # first ones start decoding while the last are still prefilling.
    prefill_steps = -(-batch * context // eng.config.max_num_batched_tokens)
    max_tokens = 2 * steps + prefill_steps + (2 * PROFILE_STEPS if profile else 0) + 16
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, _prompt(rng, context, vocab), params)
    sched = eng.scheduler
    while sched.waiting or any(s.num_tokens - s.num_computed_tokens != 1 for s in sched.running):
        eng.step()  # prefill until every sequence decodes
    times = _step_seconds(eng, steps)  # the step as it runs: its one device sync is the sampler's copy back
    # Then the host's share, in steps of their own: a sync after the model's step (so that its
    # time is the device's) would delay the sampler's launches in the timed steps above.
    inside, execute = [], eng.executor.execute

    def timed_execute(*args, **kwargs):
        start = perf_counter()
        out = execute(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the model's step, not the host's wait for it later
        inside.append(perf_counter() - start)
        return out

    eng.executor.execute = timed_execute
    try:
        whole = _step_seconds(eng, steps)
    finally:
        del eng.executor.execute
    if profile:
        try:  # the figures above are this mode's own: a profiler that fails must not lose them
            write_profile(eng, profile, batch)
        except Exception:
            Path(profile).write_text(f"the profile of batch {batch} failed:\n{traceback.format_exc()}")
            traceback.print_exc()
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return 1000 * statistics.median(times), 1000 * statistics.median(t - i for t, i in zip(whole, inside))


PROFILE_STEPS = 5


def _step_seconds(eng, steps: int) -> list[float]:
    """The wall time of each of `steps` engine steps."""
    out = []
    for _ in range(steps):
        start = perf_counter()
        eng.step()
        out.append(perf_counter() - start)
    return out


def write_profile(eng, path: str, batch: int, steps: int = PROFILE_STEPS) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step()
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    host = io.StringIO()  # the engine's Python per step (scheduler, inputs, sampling, outputs)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [eng.step() for _ in range(steps)])
    pstats.Stats(profiler, stream=host).sort_stats("cumulative").print_stats(30)
    Path(path).write_text(f"{steps} decode steps at batch {batch}\n\n"
                          + averages.table(sort_by=sort, row_limit=30) + "\n\n"
                          + averages.table(sort_by="self_cpu_time_total", row_limit=20) + "\n\n"
                          + host.getvalue())


def prefill_tok_s(llm, prompts: int, length: int, rng: random.Random) -> float:
    from engine import SamplingParams

    vocab = llm.engine.executor.info.vocab_size
    work = [_prompt(rng, length, vocab) for _ in range(prompts)]  # fresh ids: no prefix-cache hits
    start = perf_counter()
    llm.generate(work, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return prompts * length / (perf_counter() - start)


def run_mode(args, model: Path, eager: bool, profile: bool) -> dict:
    from engine import LLM

    t0 = perf_counter()
    llm = LLM(model=str(model), dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=eager)
    load_s = perf_counter() - t0
    rng = random.Random(args.seed)
    prefill_tok_s(llm, 2, 64, rng)  # warm-up: kernels compile
    decode_step_ms(llm, 1, 16, 2, rng)
    out = {"mode": "eager" if eager else "cuda-graphs", "load_s": load_s,
           "prefill_tok_s": prefill_tok_s(llm, args.prefill_prompts, args.prefill_len, rng), "decode": {}}
    for b in args.batch_sizes:
        path = args.profile if profile and b == max(args.batch_sizes) else None
        ms, host_ms = decode_step_ms(llm, b, args.context, args.steps, rng, path)
        out["decode"][b] = {"step_ms": ms, "tok_s": b * 1000 / ms, "host_ms": host_ms}
        print(f"  {out['mode']}: batch {b}: {ms:.2f} ms/step = {b * 1000 / ms:.0f} tok/s (host {host_ms:.2f} ms)",
              flush=True)
    print(f"  {out['mode']}: prefill {out['prefill_tok_s']:.0f} tok/s (load {load_s:.1f}s)", flush=True)
    del llm
    gc.collect()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local model dir (default: the embedded SmolLM2)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE", help="as benchmarks/offline.py")
    p.add_argument("--model-cache", default=None, metavar="DIR")
    p.add_argument("--tokenizer", default=None, metavar="DIR")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU (the engine's own default there; its native "
                        "kernels are float32 only)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--batches", default="1,64,256", help="decode batch sizes, comma list")
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--prefill-prompts", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--modes", default="graphs,eager",
                   help="graphs, eager or both (comma list), each in its own process; the first is profiled "
                        "(--profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--profile", default=None, metavar="PATH", help="torch.profiler tables of 5 decode steps")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    args.enforce_eager = False
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from benchmarks.offline import model_dir

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model = model_dir(args)
    print(f"model {model} ({args.dtype}, {args.device}); decode batches {args.batch_sizes} at ~{args.context} "
          f"tokens of context; prefill {args.prefill_prompts} x {args.prefill_len} tokens", flush=True)
    modes, results = args.modes.split(","), []
    for i, mode in enumerate(modes):
        run = run_mode if len(modes) == 1 else run_mode_apart
        result = run(args, model, mode == "eager", profile=i == 0)
        if result is not None:
            results.append(result)
            report(args, results)  # after each mode: a run cut short keeps what it measured


def run_mode_apart(args, model: Path, eager: bool, profile: bool) -> dict | None:
    """run_mode in a fresh process; None (and why, printed) if it failed."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        try:
            return pool.submit(run_mode, args, model, eager, profile).result()
        except Exception as e:  # BrokenProcessPool too: the child died
            print(f"  {'eager' if eager else 'cuda-graphs'}: failed: {e!r}", flush=True)
            traceback.print_exception(e)  # with the child's own traceback (its __cause__)
            return None


def report(args, results: list[dict]) -> None:
    rows = [[r["mode"]] + [f"{r['decode'][b]['step_ms']:.2f} ms ({r['decode'][b]['tok_s']:.0f} tok/s, "
                           f"host {r['decode'][b]['host_ms']:.2f})" for b in args.batch_sizes]
            + [f"{r['prefill_tok_s']:.0f}"] for r in results]
    print("\n" + markdown_table(["mode"] + [f"decode step, batch {b}" for b in args.batch_sizes] + ["prefill tok/s"],
                                rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args), "results": results},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
