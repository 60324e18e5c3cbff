"""The paged-attention kernel alone (engine.kernels.paged_attention), for what a GPU run must settle:

    splits  a decode launch at each batch size and context length, timed at every split count;
            the fastest against the one decode_splits picks (WAVES programs per SM), and the
            programs per SM the fastest had: what WAVES should be
    mixed   a step of prefill chunks beside decodes, the decodes in a launch of their own at decode
            tiles (what the engine does) against every row in the prefill launch (what it did)

Each case's outputs are compared with the unsplit / one-launch output first: a split count or a
launch layout that computes something else fails the run, not just the timing. The pool's
blocks are shuffled over each sequence's table, as a pool that has served a while holds them.

    python benchmarks/attention_splits.py --json out.json      # on a GPU: SmolLM2's and Qwen3-0.6B's heads

On a CPU-only host the kernels run under Triton's interpreter (TRITON_INTERPRET=1), which checks
the script, not the kernel's speed.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script or as a module

from benchmarks.common import machine_info, markdown_table  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-0.6b": (16, 8, 128), "tiny": (4, 2, 16)}  # query heads, KV heads, dim


def make_case(shape: str, seqs: list[tuple[int, int]], block_size: int, dtype, device, seed: int = 0) -> dict:
    """seqs: (context length, query rows) each -> q, a pool holding every context in shuffled
    blocks, and the kernel's metadata."""
    import torch

    h, kvh, d = SHAPES[shape]
    rng = random.Random(seed)
    need = [-(-n // block_size) for n, _ in seqs]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    width, tables, used = max(need), [], 0
    for n in need:
        tables.append(ids[used:used + n] + [0] * (width - n))
        used += n
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache = torch.randn(len(ids), block_size, kvh, d, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(len(ids), block_size, kvh, d, generator=gen, device=device).to(dtype)
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    return dict(q=torch.randn(starts[-1], h, d, generator=gen, device=device).to(dtype), k_cache=k_cache,
                v_cache=v_cache, block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
                query_start=torch.tensor(starts, dtype=torch.int32, device=device), scale=d ** -0.5)


def attend(case: dict, num_chunk_seqs: int, num_chunk_tokens: int, num_splits: int | None = None):
    from engine.kernels.paged_attention import paged_attention

    return paged_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                           case["query_start"], case["scale"], num_chunk_seqs, num_chunk_tokens,
                           num_splits=num_splits)


def time_ms(fn, device) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA (L2 cleared between runs); a wall-clock
    mean of two runs elsewhere (the interpreter: checks the script only)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    start = perf_counter()
    for _ in range(2):
        fn()
    return (perf_counter() - start) / 2 * 1e3


def _check(out, ref, what: str) -> None:
    import torch

    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def sweep_splits(shape: str, batches: list[int], contexts: list[int], splits: list[int], block_size: int, dtype,
                 device, log=print) -> list[dict]:
    from engine.kernels.paged_attention import _num_sms, decode_splits

    kvh = SHAPES[shape][1]
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 1
    rows = []
    for batch in batches:
        for context in contexts:
            case = make_case(shape, [(context, 1)] * batch, block_size, dtype, device, seed=batch + context)
            ref = attend(case, 0, 0, 1)
            times = {}
            for s in splits:
                _check(attend(case, 0, 0, s), ref, f"{shape} batch {batch} context {context} splits {s}")
                times[s] = time_ms(lambda s=s: attend(case, 0, 0, s), device)
            best = min(times, key=times.get)
            chosen = decode_splits(batch, kvh, device)
            chosen_ms = times[chosen] if chosen in times else time_ms(lambda: attend(case, 0, 0, chosen), device)
            rows.append(dict(shape=shape, batch=batch, context=context, ms=times, best=best, chosen=chosen,
                             chosen_over_best=chosen_ms / times[best],
                             best_programs_per_sm=best * batch * kvh / sms))
            log(f"  {shape} batch {batch} context {context}: " + ", ".join(f"{s}: {t:.3f}" for s, t in times.items())
                + f" ms; best {best}, decode_splits {chosen}")
    return rows


def sweep_mixed(shape: str, chunk: int, decodes: list[int], context: int, block_size: int, dtype, device,
                log=print) -> list[dict]:
    rows = []
    for n in decodes:
        seqs = [(chunk, chunk)] + [(context, 1)] * n
        case = make_case(shape, seqs, block_size, dtype, device, seed=n)
        total = chunk + n
        one = attend(case, len(seqs), total)  # every row at prefill tiles, one launch
        _check(attend(case, 1, chunk), one, f"{shape} mixed, {n} decodes")
        apart = time_ms(lambda: attend(case, 1, chunk), device)
        together = time_ms(lambda: attend(case, len(seqs), total), device)
        rows.append(dict(shape=shape, chunk=chunk, decodes=n, context=context, two_launches_ms=apart,
                         one_launch_ms=together, speedup=together / apart))
        log(f"  {shape} chunk {chunk} + {n} decodes at {context}: two launches {apart:.3f} ms, "
            f"one {together:.3f} ms")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,qwen3-0.6b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,4,16,64,128,256", help="decode batch sizes")
    p.add_argument("--contexts", default="512,2048", help="decode context lengths")
    p.add_argument("--splits", default="1,2,4,8,16")
    p.add_argument("--mixed-chunk", type=int, default=512, help="the mixed step's prefill chunk")
    p.add_argument("--mixed-decodes", default="4,64,200", help="decodes beside it")
    p.add_argument("--mixed-context", type=int, default=1024)
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    result = {"machine": machine_info(), "args": vars(args), "splits": [], "mixed": []}
    for shape in args.shapes.split(","):  # a shape's tables as soon as it is done: a run cut short keeps them
        print(f"{shape} ({dtype}, {device}): decode launches", flush=True)
        splits = sweep_splits(shape, ints(args.batches), ints(args.contexts), ints(args.splits), args.block_size,
                              dtype, device)
        print(f"{shape}: mixed steps", flush=True)
        mixed = sweep_mixed(shape, args.mixed_chunk, ints(args.mixed_decodes), args.mixed_context, args.block_size,
                            dtype, device)
        report(splits, mixed)
        result["splits"] += splits
        result["mixed"] += mixed
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(splits: list[dict], mixed: list[dict]) -> None:
    print("\n" + markdown_table(
        ["shape", "batch", "context", "fastest splits (ms)", "decode_splits (ms)", "slower by", "programs/SM at fastest"],
        [[r["shape"], r["batch"], r["context"], f"{r['best']} ({r['ms'][r['best']]:.3f})",
          f"{r['chosen']} ({r['chosen_over_best'] * r['ms'][r['best']]:.3f})", f"{r['chosen_over_best']:.2f}x",
          f"{r['best_programs_per_sm']:.1f}"] for r in splits]))
    print("\n" + markdown_table(
        ["shape", "mixed step", "decodes apart (ms)", "one launch (ms)", "speedup"],
        [[r["shape"], f"{r['chunk']} + {r['decodes']} x {r['context']}", f"{r['two_launches_ms']:.3f}",
          f"{r['one_launch_ms']:.3f}", f"{r['speedup']:.2f}x"] for r in mixed]), flush=True)


if __name__ == "__main__":
    main()
