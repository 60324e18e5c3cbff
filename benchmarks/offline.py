"""Offline throughput: kvserve against Hugging Face transformers, same prompts, same output lengths.

Three systems run in one process on one seeded workload (random prompt token ids, a requested
output length per prompt, greedy, EOS ignored, so every system generates exactly the same tokens):

    kvserve    LLM(...).generate(prompts, [SamplingParams(max_tokens=m_i, ignore_eos=True), ...])
    hf-static  model.generate on static batches of --hf-batch-size, left padded; a batch runs to
               its longest request, but only each prompt's requested tokens count as output
    hf-batch   transformers' paged continuous batching (the manager behind model.generate_batch),
               with the same per-request lengths, scheduler limits and enough KV for the workload

Each system is loaded (timed apart), warmed up on a tiny workload, then timed on the real one.

    python benchmarks/offline.py                                   # 64 prompts, all systems
    python benchmarks/offline.py --num-prompts 4 --max-output 8 --systems kvserve,hf-batch
    python benchmarks/offline.py --preset nano-vllm --systems kvserve,hf-static   # on a GPU
    python benchmarks/offline.py --systems kvserve,kvserve-lora --lora-adapters 2  # what adapters cost

kvserve-lora is kvserve with every prompt running under one of --lora-adapters random LoRA
adapters (rank --lora-rank, all seven projections; benchmarks/random_model.py), in turn.

Presets set a workload's defaults (explicit flags still win). `nano-vllm` is the workload nano-vllm
and mini-sglang report: 256 sequences, random prompt ids of 100-1024 tokens, 100-1024 output
tokens, EOS ignored, seed 0, on SmolLM2-135M's shape with random bfloat16 weights (real weights
need not travel to the GPU host; benchmarks/random_model.py). HF static batching runs on the first
--hf-num-prompts (16: one batch) prompts only, its tok/s over those: all 256 would take it most of
ten minutes.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script or as a module

from benchmarks.common import machine_info, markdown_table, print_machine, step_means, step_totals  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

SYSTEMS = ("kvserve", "kvserve-lora", "hf-static", "hf-batch")
FIRST_PROMPT_TOKEN = 100  # random prompt ids skip the special tokens at the start of the vocab
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks_override",
                "kv_cache_memory", "enforce_eager")
PRESETS = {
    "nano-vllm": dict(num_prompts=256, min_input=100, max_input=1024, min_output=100, max_output=1024, seed=0,
                      dtype="bfloat16", random_weights="smollm2-135m", max_num_seqs=256,
                      max_num_batched_tokens=16384, hf_batch_size=16, hf_num_prompts=16),
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]  # tokens to generate for each prompt

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    system: str
    load_s: float
    seconds: float  # the timed run only: no load, no warm-up
    output_tokens: int  # requested tokens, what every system must produce
    computed_tokens: int  # tokens actually generated (a static batch runs to its longest request)
    outputs: list[list[int]] = field(repr=False)  # per prompt, cut to its requested length
    notes: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                  vocab_size: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(*input_range))]
               for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def timed(fn: Callable, *args):
    start = perf_counter()
    value = fn(*args)
    return value, perf_counter() - start


def check_lengths(system: str, outputs: list[list[int]], work: Workload) -> None:
    bad = [i for i, (out, m) in enumerate(zip(outputs, work.output_lens)) if len(out) != m]
    if bad:
        i = bad[0]
        raise RuntimeError(f"{system}: {len(bad)} prompts got the wrong number of tokens "
                           f"(prompt {i}: {len(outputs[i])}, wanted {work.output_lens[i]})")


# --- kvserve ---------------------------------------------------------------------------------

def bench_kvserve(args, model_path: Path, work: Workload, warm: Workload, lora: bool = False) -> Result:
    """`lora`: every prompt runs with one of --lora-adapters random adapters of rank --lora-rank,
    in turn (kvserve-lora)."""
    from benchmarks.random_model import cached_random_adapter
    from engine import LLM, LoRARequest, SamplingParams

    flags = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) not in (None, False)}
    if lora:
        flags.update(enable_lora=True, max_loras=args.lora_adapters, max_lora_rank=max(16, args.lora_rank))
    llm, load_s = timed(lambda: LLM(model=str(model_path), dtype=args.dtype, device=args.device, **flags))
    adapters = [LoRARequest(f"a{i}", i + 1, str(cached_random_adapter(model_path, args.lora_rank, seed=i)))
                for i in range(args.lora_adapters if lora else 0)]

    def generate(w: Workload, progress: bool) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in w.output_lens]
        loras = [adapters[i % len(adapters)] for i in range(len(w.prompts))] if lora else None
        outs = llm.generate(w.prompts, params, use_tqdm=progress, lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(warm, False)
    warm_steps = step_totals(llm.engine.stats())
    outputs, seconds = timed(generate, work, True)
    stats = llm.engine.stats()
    note = (f"{stats.num_total_blocks} KV blocks of {stats.block_size} tokens, "
            f"{stats.num_preemptions} preemptions (incl. warm-up)")
    for kind, (steps, ms) in step_means(warm_steps, step_totals(stats)).items():  # the timed run's (as serve.py)
        note += f"; {steps:.0f} {kind} steps of {ms:.1f} ms"
    graphs = getattr(llm.engine.executor.runner, "graphs", None)
    if graphs is not None:
        note += f"; {graphs.replays} decode steps as CUDA graphs (incl. warm-up)"
    if lora:
        note += f"; {args.lora_adapters} LoRA adapters of rank {args.lora_rank}, the prompts in turn"
    return Result("kvserve-lora" if lora else "kvserve", load_s, seconds, work.output_tokens, work.output_tokens,
                  outputs, [note])


# --- Hugging Face: shared ----------------------------------------------------------------------

def load_hf(model_path: Path, args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").to(args.device).eval()
    # generate() fills unset fields from model.generation_config: clear eos there, or it comes back.
    model.generation_config.eos_token_id = None
    return model


# --- Hugging Face generate, static batches -----------------------------------------------------

def bench_hf_static(args, model_path: Path, work: Workload, warm: Workload) -> Result:
    from tqdm import tqdm

    model, load_s = timed(load_hf, model_path, args)
    batches = [range(i, min(i + args.hf_batch_size, len(work.prompts)))
               for i in range(0, len(work.prompts), args.hf_batch_size)]

    def run() -> tuple[list[list[int]], int]:
        outputs, computed = [], 0
        for idx in tqdm(batches, desc="hf-static", unit="batch"):
            rows = static_batch(model, [work.prompts[i] for i in idx], max(work.output_lens[i] for i in idx))
            outputs += [row[:work.output_lens[i]] for i, row in zip(idx, rows)]
            computed += sum(map(len, rows))
        return outputs, computed

    static_batch(model, warm.prompts, max(warm.output_lens))
    (outputs, computed), seconds = timed(run)
    note = f"batches of {args.hf_batch_size} in prompt order, each generating to its longest request"
    return Result("hf-static", load_s, seconds, work.output_tokens, computed, outputs, [note])


def static_batch(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy `generate` on one left-padded batch; every row gets exactly `max_new` new tokens."""
    import torch
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=config)  # (B, T + max_new)
    if out.shape[1] != width + max_new:
        raise RuntimeError(f"hf-static: generate stopped after {out.shape[1] - width} of {max_new} tokens")
    return out[:, width:].tolist()


# --- Hugging Face continuous batching ----------------------------------------------------------

def bench_hf_batch(args, model_path: Path, work: Workload, warm: Workload) -> Result:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, load_s = timed(load_hf, model_path, args)
    cb_config = ContinuousBatchingConfig(
        num_blocks=args.hf_num_blocks or hf_blocks_needed(work, ContinuousBatchingConfig.page_size),
        max_batch_tokens=args.max_num_batched_tokens, max_requests_per_batch=args.max_num_seqs)
    hints = WorkloadHints(max_prompt_length=max(map(len, work.prompts)),
                          max_generated_length=max(work.output_lens), num_requests=len(work.prompts))
    # eos -1 disables EOS; max_new_tokens is only the default, each request passes its own.
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(work.output_lens))
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True,
                                                   continuous_batching_config=cb_config,
                                                   workload_hints=hints) as manager:
        cb_generate(manager, warm, "hf-batch warm-up", progress=False)
        outputs, seconds = timed(cb_generate, manager, work, "hf-batch", True)
        resolved = manager.continuous_batching_config  # what HF made of cb_config once its cache existed
        note = (f"KV for {resolved.num_blocks} blocks of {resolved.page_size} tokens, max_batch_tokens "
                f"{resolved.max_batch_tokens}, max_requests_per_batch {resolved.max_requests_per_batch}")
    return Result("hf-batch", load_s, seconds, work.output_tokens, work.output_tokens, outputs, [note])


def hf_blocks_needed(work: Workload, page_size: int) -> int:
    """Enough KV pages to hold every request at once, so that HF never has to evict."""
    return sum(math.ceil((len(p) + m) / page_size) for p, m in zip(work.prompts, work.output_lens))


def cb_generate(manager, work: Workload, label: str, progress: bool) -> list[list[int]]:
    """What `generate_batch` does, but with each request's own max_new_tokens (it takes one for all)."""
    from tqdm import tqdm

    ids = [f"{label}-{i}" for i in range(len(work.prompts))]
    for rid, prompt, m in zip(ids, work.prompts, work.output_lens):
        manager.add_request(prompt, request_id=rid, max_new_tokens=m, eos_token_id=-1)
    done = {}
    with tqdm(total=len(ids), desc=label, unit="req", disable=not progress) as bar:
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None and not manager.is_running():
                raise RuntimeError(f"hf-batch: generation thread died with {len(ids) - len(done)} requests left")
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"hf-batch: request {out.request_id} failed: {out.error}")
                done[out.request_id] = out.generated_tokens
                bar.update(1)
    return [list(done[rid]) for rid in ids]


BENCHES = {"kvserve": bench_kvserve, "kvserve-lora": lambda *a: bench_kvserve(*a, lora=True),
           "hf-static": bench_hf_static, "hf-batch": bench_hf_batch}


# --- report ------------------------------------------------------------------------------------

def agreement(ref: Result, other: Result) -> dict:
    """Exact greedy matches per prompt, and how far the mismatches agree before diverging."""
    matches, first_diffs = 0, []
    for a, b in zip(ref.outputs, other.outputs):
        if a == b:
            matches += 1
        else:
            first_diffs.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
    return {"system": other.system, "exact": matches, "prompts": min(len(ref.outputs), len(other.outputs)),
            "first_diff_positions": first_diffs}


def print_report(results: list[Result], agreements: list[dict]) -> None:
    base = next((r.tok_s for r in results if r.system == "kvserve"), None)
    rows = [[r.system, len(r.outputs), r.output_tokens, f"{r.seconds:.2f}", f"{r.tok_s:.1f}",
             f"{base / r.tok_s:.2f}x" if base else "-"] for r in results]
    print("\n" + markdown_table(["system", "prompts", "output tokens", "seconds", "tok/s", "kvserve tok/s / this"],
                                rows))
    print("\noutput tokens = the tokens the prompts asked for (extra tokens a static batch computes for its "
          "shorter rows do not count); seconds = the timed run only, after load and warm-up.")
    for r in results:
        extra = f", computed {r.computed_tokens} tokens" if r.computed_tokens != r.output_tokens else ""
        print(f"  {r.system}: load {r.load_s:.1f}s{extra}; " + "; ".join(r.notes))
    for a in agreements:
        diffs = a["first_diff_positions"]
        shown = ", ".join(map(str, sorted(diffs)[:10])) + (", ..." if len(diffs) > 10 else "")
        where = f" (the others first differ at token {shown})" if diffs else ""
        print(f"greedy agreement kvserve vs {a['system']}: {a['exact']}/{a['prompts']} prompts identical{where}")
    if agreements:
        print("(informative only: in bfloat16 two implementations round differently, and random weights' "
              "near-flat logits turn that into early divergence; exactness is tests/test_engine_cuda.py's)")


def write_json(path: str, args, info: dict, work: Workload, results: list[Result], agreements: list[dict]):
    doc = {"machine": info, "args": vars(args),
           "workload": {"prompts": len(work.prompts), "input_tokens": sum(map(len, work.prompts)),
                        "output_tokens": work.output_tokens},
           "results": [{k: v for k, v in asdict(r).items() if k != "outputs"} | {"tok_s": r.tok_s}
                       for r in results],
           "agreement": agreements}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


# --- main --------------------------------------------------------------------------------------

def engine_default(name: str):
    return next(f.default for f in fields(EngineConfig) if f.name == name)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a workload's defaults (see above)")
    p.add_argument("--model", default=None, help="local model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help="instead of --model: random weights of this shape (smollm2-135m, qwen3-0.6b, tiny), made once in --model-cache")
    p.add_argument("--model-cache", default=None, metavar="DIR",
                   help="where --random-weights models are made (default: $KVSERVE_CACHE/random-models)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="--random-weights: copy this tokenizer (default: a synthesized one, one token per id)")
    p.add_argument("--systems", default="kvserve,hf-static,hf-batch", help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input", type=int, default=None, help="default: 32, or --max-input when less")
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=None, help="default: 32, or --max-output when less")
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--lora-rank", type=int, default=16, help="kvserve-lora: the random adapters' rank")
    p.add_argument("--lora-adapters", type=int, default=1, help="kvserve-lora: how many adapters (max_loras)")
    engine = p.add_argument_group("kvserve engine (vLLM names); hf-batch shares the two scheduler limits")
    engine.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"))
    engine.add_argument("--max-num-batched-tokens", type=int, default=engine_default("max_num_batched_tokens"))
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    engine.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    hf = p.add_argument_group("Hugging Face")
    hf.add_argument("--hf-batch-size", type=int, default=16, help="hf-static batch size")
    hf.add_argument("--hf-model", default=None, metavar="DIR",
                    help="the checkpoint HF runs, where it cannot read --model: a GPTQ/AWQ one's float weights "
                         "(benchmarks/quantize.py --reference)")
    hf.add_argument("--hf-num-prompts", type=int, default=None,
                    help="HF systems run on the first N prompts only (default: all)")
    hf.add_argument("--hf-num-blocks", type=int, default=None,
                    help="hf-batch KV blocks of 256 tokens (default: enough for every request at once)")
    args = p.parse_args(argv)
    if args.preset:  # the preset's values become defaults; flags given explicitly still win
        p.set_defaults(**PRESETS[args.preset])
        args = p.parse_args(argv)
    for side in ("input", "output"):
        if getattr(args, f"min_{side}") is None:
            setattr(args, f"min_{side}", min(32, getattr(args, f"max_{side}")))
    validate(p, args)
    return args


def validate(p: argparse.ArgumentParser, args) -> None:
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not 1 <= args.min_input <= args.max_input:
        p.error("need 1 <= --min-input <= --max-input")
    if not 1 <= args.min_output <= args.max_output:
        p.error("need 1 <= --min-output <= --max-output")
    if args.num_prompts < 1 or args.hf_batch_size < 1:
        p.error("--num-prompts and --hf-batch-size must be >= 1")


def head(work: Workload, n: int) -> Workload:
    return Workload(work.prompts[:n], work.output_lens[:n])


def model_dir(args) -> Path:
    from engine.model_source import cache_dir, resolve_model

    if args.model or not args.random_weights:  # an explicit --model wins over a preset's random weights
        return resolve_model(args.model)
    from benchmarks.random_model import make_random_model

    cache = Path(args.model_cache) if args.model_cache else cache_dir() / "random-models"
    return make_random_model(cache / f"{args.random_weights}-{args.dtype}", args.random_weights, args.dtype,
                             args.tokenizer)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_path = model_dir(args)
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    work = make_workload(args.num_prompts, (args.min_input, args.max_input),
                         (args.min_output, args.max_output), args.seed, vocab)
    warm = make_workload(2, (8, 16), (4, 4), args.seed + 1, vocab)  # other tokens: no prefix-cache hits
    info = machine_info()
    print_machine(info)
    print(f"model {model_path} ({args.dtype}, {args.device}); {len(work.prompts)} prompts, "
          f"{sum(map(len, work.prompts))} input and {work.output_tokens} output tokens "
          f"(greedy, EOS ignored, seed {args.seed})")

    results, agreements = [], []
    for system in args.systems.split(","):
        print(f"\n== {system}", flush=True)
        own = work if system.startswith("kvserve") or not args.hf_num_prompts else head(work, args.hf_num_prompts)
        try:  # one system that fails (a peer's version, its time box) leaves the others' figures
            path = Path(args.hf_model) if args.hf_model and system.startswith("hf") else model_path
            result = BENCHES[system](args, path, own, warm)
            check_lengths(system, result.outputs, own)
        except Exception:
            traceback.print_exc()
            print(f"{system}: failed", flush=True)
            continue
        print(f"{system}: {result.output_tokens} tokens in {result.seconds:.2f}s = {result.tok_s:.1f} tok/s "
              f"(load {result.load_s:.1f}s); " + "; ".join(result.notes), flush=True)
        results.append(result)
        ref = next((r for r in results if r.system == "kvserve"), None)
        agreements = [agreement(ref, r) for r in results if ref and r is not ref and r.system != "kvserve-lora"]
        if args.json:  # after each system: a run cut short keeps what it measured
            write_json(args.json, args, info, work, results, agreements)
        gc.collect()  # the previous system's model and KV cache, before the next one loads
    print_report(results, agreements)


if __name__ == "__main__":
    main()
