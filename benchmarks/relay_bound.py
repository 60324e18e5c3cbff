"""The engine behind a relay that costs CPU per message: what a replica's streams carry when the
event loop that relays them is slower than the engine steps.

    python benchmarks/relay_bound.py --random-weights tiny --streams 128 --relay-us 150

`AsyncEngine` on a model (default: SmolLM2's vocabulary around a 2-layer, 64-wide random model,
whose step is mostly the engine's own work), `--streams` concurrent greedy requests of
`--output-len` tokens, and each stream spending `--relay-us` of CPU on the event loop per output
it takes, as Serve's transport does per streamed message in a replica (~160 us, measured in
docs/benchmarks.md). Reported: output tokens a second, tokens per output (above 1: the stream
took several steps as one), and the engine's decode step time.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


async def _stream(engine, rid: str, prompt: list[int], params, relay_us: float) -> tuple[int, int]:
    tokens = outputs = 0
    async for out in engine.generate(rid, prompt, params):
        tokens += len(out.outputs[0].delta_token_ids)
        outputs += 1
        _busy(relay_us)  # holds the event loop, as a relay's per-message work does
    return tokens, outputs


async def run(args) -> dict:
    import engine as engines
    from engine import SamplingParams

    make = engines.ProcessEngine if args.engine == "process" else engines.AsyncEngine
    engine = make(model=str(args.model_dir), max_num_seqs=args.streams, device="cpu",
                  num_gpu_blocks_override=args.streams * (args.prompt_len + args.output_len) // 16 + 64)
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    await _stream(engine, "warm", prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 0)
    before = engine.stats()
    start = time.perf_counter()
    done = await asyncio.gather(*(_stream(engine, f"r{i}", p, params, args.relay_us) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    after = engine.stats()
    await engine.shutdown()
    tokens, outputs = sum(t for t, _ in done), sum(o for _, o in done)
    steps = after.decode_steps - before.decode_steps
    return {"tok_s": tokens / wall, "tokens_per_output": tokens / outputs, "wall_s": wall,
            "decode_step_ms": 1e3 * (after.decode_step_seconds - before.decode_step_seconds) / max(1, steps)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local model dir (default: --random-weights)")
    p.add_argument("--random-weights", default="tiny", metavar="SHAPE", help="as benchmarks/offline.py (default: tiny)")
    p.add_argument("--model-cache", default=None, metavar="DIR")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--relay-us", type=float, default=150.0, help="CPU us on the event loop per output taken")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--engine", choices=("thread", "process"), default="thread",
                   help="AsyncEngine (steps on a thread of the relay's process) or ProcessEngine (the "
                        "engine core in a process of its own)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run (default: Python's, 5 ms)")
    args = p.parse_args(argv)
    import torch

    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    from benchmarks.offline import model_dir

    torch.set_num_threads(args.threads)
    args.dtype, args.tokenizer = "float32", None
    args.model_dir = model_dir(args)
    r = asyncio.run(run(args))
    print(f"{args.engine}: {args.streams} streams x {args.output_len} tokens, relay {args.relay_us:g} us/output: "
          f"{r['tok_s']:.0f} tok/s, {r['tokens_per_output']:.2f} tokens/output, "
          f"decode step {r['decode_step_ms']:.2f} ms, {r['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
