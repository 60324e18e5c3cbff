"""Embedding throughput: kvserve's pooling runner against vLLM's CPU build and HF transformers, on
the same inputs, and whether their vectors agree.

    python benchmarks/embeddings.py                               # kvserve, vllm, hf
    python benchmarks/embeddings.py --systems kvserve,hf --num-inputs 64
    python benchmarks/embeddings.py --systems kvserve,hf --random-weights bert-base --max-len 512

    kvserve  `kvserve serve --runner pooling`, launched here and loaded over HTTP
    vllm     `vllm serve --runner pooling` (vLLM's CPU build: `python benchmarks/vllm_cpu.py install`)
    hf       transformers' base model (AutoModel) in this process on batches of --hf-batch-size
             inputs sorted by length and right-padded, each input's last real token pooled (an
             encoder's first, its [CLS]) and L2-normalised: what sentence-transformers does for a
             last-token-pooling decoder and a CLS-pooling encoder

Inputs: --num-inputs sequences of random token ids, --min-len to --max-len tokens (seeded), sent
as token ids so that every system embeds exactly the same tokens. The servers are launched one at
a time (they would share the cores) and loaded by --concurrency clients, each posting --batch
inputs per /v1/embeddings request. Reported: input tokens/s and requests/s, each against HF in
the same run, and the largest |difference| of each system's vectors from HF's (float32 weights
and arithmetic everywhere by default: all three compute the same function).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_cpu  # noqa: E402
from benchmarks.common import free_port, machine_info, markdown_table, print_machine  # noqa: E402
from benchmarks.serve import SERVED_NAME, Launched  # noqa: E402

SYSTEMS = ("kvserve", "vllm", "hf")


def make_inputs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_embeddings(model_dir: str, inputs: list[list[int]], batch_size: int, dtype: str) -> tuple[list, float]:
    """-> (the vectors in input order, seconds), the model loaded and warmed up before the clock."""
    import torch
    from transformers import AutoModel

    from engine.model_source import ENCODER_MODEL_TYPES

    model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    cls = model.config.model_type in ENCODER_MODEL_TYPES
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list = [None] * len(inputs)

    def run(indices: list[int]) -> None:
        width = max(len(inputs[i]) for i in indices)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            ids[row, :len(inputs[i])], mask[row, :len(inputs[i])] = torch.tensor(inputs[i]), 1
        with torch.inference_mode():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = (h[:, 0] if cls else h[torch.arange(len(indices)), mask.sum(1) - 1]).float()
            for row, v in zip(indices, torch.nn.functional.normalize(last, dim=-1)):
                out[row] = v.tolist()

    run(order[:2])  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        run(order[start:start + batch_size])
    return out, time.perf_counter() - t0


async def load(url: str, inputs: list[list[int]], concurrency: int, batch: int) -> tuple[list, float, int]:
    """-> (vectors in input order, seconds, requests), `concurrency` clients taking the next batch."""
    out: list = [None] * len(inputs)
    batches = [list(range(i, min(i + batch, len(inputs)))) for i in range(0, len(inputs), batch)]
    queue = iter(batches)

    async def client(http: httpx.AsyncClient) -> None:
        for idx in queue:
            r = await http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": [inputs[i] for i in idx],
                                                        "encoding_format": "float"})
            r.raise_for_status()
            for i, d in zip(idx, r.json()["data"]):
                out[i] = d["embedding"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await client_warm_up(http, inputs)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return out, time.perf_counter() - t0, len(batches)


async def client_warm_up(http: httpx.AsyncClient, inputs: list[list[int]]) -> None:
    r = await http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": inputs[:4]})
    r.raise_for_status()


async def wait_ready(url: str, proc, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}; see its log")
            try:
                if (await http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": [5, 6]})).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def served(system: str, model_dir: str, inputs: list[list[int]], args) -> tuple[list, float, int]:
    launch_args = argparse.Namespace(log_dir=args.log_dir, max_model_len=args.max_model_len, dtype=args.dtype,
                                     lora_rank=0, vllm_venv=args.vllm_venv, kvserve_arg=["--runner", "pooling"],
                                     vllm_arg=["--runner", "pooling"], transformers_arg=[])
    port = free_port()
    print(f"starting {system} (log: {args.log_dir}/{system}.log) ...", flush=True)
    with Launched(system, port, model_dir, launch_args) as server:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url, server.proc))
        return asyncio.run(load(url, inputs, args.concurrency, args.batch))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--model-dir", help="default: the embedded SmolLM2")
    p.add_argument("--random-weights", metavar="SHAPE", help="instead of --model-dir: random weights of a "
                   "benchmarks/random_model.py shape (bert-base, smollm2-135m, ...), made once in $KVSERVE_CACHE")
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="inputs per /v1/embeddings request")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-venv", type=Path, default=vllm_cpu.DEFAULT_VENV)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.random_weights:
        from benchmarks.random_model import make_random_model
        from engine.model_source import cache_dir

        args.model_dir = str(make_random_model(cache_dir() / "random-models" / f"{args.random_weights}-float32",
                                               args.random_weights, "float32"))
    if args.model_dir is None:
        from engine.config import EngineConfig
        from engine.model_source import model_dir

        args.model_dir = str(model_dir(EngineConfig()))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    inputs = make_inputs(args.num_inputs, args.min_len, args.max_len, vocab, args.seed)
    tokens = sum(map(len, inputs))
    info = machine_info()
    print_machine(info)
    print(f"{len(inputs)} inputs, {tokens} tokens ({args.min_len}-{args.max_len} each), {args.dtype}", flush=True)
    results, vectors = {}, {}
    for system in systems:
        if system == "hf":
            vectors[system], seconds = hf_embeddings(args.model_dir, inputs, args.hf_batch_size, args.dtype)
            requests = -(-len(inputs) // args.hf_batch_size)
        else:
            vectors[system], seconds, requests = served(system, args.model_dir, inputs, args)
        results[system] = {"seconds": seconds, "input_tok_s": tokens / seconds, "requests": requests}
        print(f"{system}: {tokens / seconds:,.0f} input tok/s ({seconds:.2f} s)", flush=True)
    base = "hf" if "hf" in vectors else systems[0]
    for system, r in results.items():
        r["max_abs_diff_vs_" + base] = max(abs(a - b) for v, w in zip(vectors[system], vectors[base])
                                          for a, b in zip(v, w))
        r["speed_vs_" + base] = r["input_tok_s"] / results[base]["input_tok_s"]
    rows = [[s, f"{r['input_tok_s']:,.0f}", f"{r['seconds']:.2f}", f"{r['speed_vs_' + base]:.2f}x",
             f"{r['max_abs_diff_vs_' + base]:.1e}"] for s, r in results.items()]
    print(markdown_table(["system", "input tok/s", "seconds", f"vs {base}", f"max |diff| vs {base}"], rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                                   "tokens": tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
