"""Serving benchmark: load any OpenAI-compatible server and report throughput and latency.

    # a running server (kvserve, vLLM, transformers serve, ...)
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --max-concurrency 1 4 16 --num-prompts 32 --random-input-len 128 --random-output-len 64

    # kvserve and `transformers serve --continuous-batching` side by side, each launched here
    python benchmarks/serve.py --launch kvserve transformers --max-concurrency 1 4 16

    # kvserve and vLLM's CPU build (`python benchmarks/vllm_cpu.py install` first), launched in
    # turn, twice, and loaded by vLLM's own client (`vllm bench serve`)
    python benchmarks/serve.py --launch kvserve vllm --rounds 2 --client vllm \\
        --max-concurrency 16 1 --num-prompts 32

Requests have random prompts of about --random-input-len tokens (optionally after a shared
prefix of --prefix-len tokens) and ask for --random-output-len tokens, both varied by
--random-range-ratio. They arrive as a Poisson process at --request-rate (gamma with
--burstiness != 1), or all at once, with at most --max-concurrency in flight. Reported per run:
request throughput, output tokens/s, and mean / median / P99 of TTFT (time to first token),
TPOT (time per output token after the first), ITL (gap between streamed chunks) and E2E latency.
TTFT ends at the first streamed chunk that carries a choice (not a chat role announcement),
with or without text, as vLLM's benchmark counts it: a server may hold back the text of tokens
that do not yet form whole UTF-8 characters (random prompts often get such replies), and
"first text" would then time the whole reply.
Output lengths are made exact where the server allows it (kvserve/vLLM `ignore_eos`,
transformers' `generation_config`), and tokens are counted from the server's `usage`.

With `--client vllm` the load comes from `vllm bench serve` (random dataset, --ignore-eos) in
vLLM's venv instead, and its JSON results fill the same table. With `--together` every launched
server is up for the whole sweep and each run loads one of them while the others idle: on a
small machine, runs of different servers then alternate in the same minutes (`--rounds`), so a
slow phase of the host hits them alike; each run also records the CPU the idle servers took.

With `--lora-rank R`, launched kvserve and vLLM also serve a random LoRA adapter of that rank
(all seven projections; benchmarks/random_model.py) as the module `bench-lora`, and every
request names it: what an adapter costs each server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_cpu  # noqa: E402
from benchmarks.common import (StepTotals, free_port, machine_info, markdown_table, print_machine,  # noqa: E402
                               step_means)
from benchmarks.proc_cpu import cpu_seconds, cpu_used  # noqa: E402

BACKENDS = ("kvserve", "vllm", "transformers", "openai")
LAUNCHABLE = ("kvserve", "vllm", "transformers")
SERVED_NAME = "bench"  # the model name launched kvserve and vLLM serve under
LORA_NAME = "bench-lora"  # and their LoRA module's, with --lora-rank


# -- workload ---------------------------------------------------------------------------------------

@dataclass
class Request:
    prompt: str
    output_len: int


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _random_text(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """Text of about n_tokens tokens: random ids, decoded, re-encoded and cut to length."""
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(min(len(tokenizer), 32000)) if t not in special]
    ids = [rng.choice(vocab) for _ in range(n_tokens)]
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def make_requests(tokenizer, args: argparse.Namespace, index: int = 0) -> list[Request]:
    """Run `index` of a sweep gets its own prompts (the shared prefix stays the same), so that no
    run is served from KV blocks an earlier run left in a server's prefix cache."""
    rng = random.Random(args.seed)
    prefix = _random_text(tokenizer, args.prefix_len, rng) if args.prefix_len else ""
    rng = random.Random(f"{args.seed}-{index}")
    ins = _lengths(args.random_input_len, args.random_range_ratio, args.num_prompts, rng)
    outs = _lengths(args.random_output_len, args.random_range_ratio, args.num_prompts, rng)
    return [Request(prefix + _random_text(tokenizer, i, rng), o) for i, o in zip(ins, outs)]


# -- one request ------------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0  # s
    e2e: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(backend: str, endpoint: str, model: str, req: Request, stream: bool = True) -> dict:
    """stream=False: the reply comes whole (TTFT and ITL are then not measured)."""
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if backend in ("kvserve", "vllm"):
        body["ignore_eos"] = True
    elif backend == "transformers":  # rejects unknown fields; its own way to a fixed length
        body["generation_config"] = json.dumps({"max_new_tokens": req.output_len, "min_new_tokens": req.output_len,
                                                "do_sample": False})
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    if not body["stream"]:
        return await send_whole(client, url, body)
    res = Result(ok=False, start=time.perf_counter())
    last, chunks = None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[5:])
                if "error" in data:
                    res.error = str(data["error"])[:200]
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                if any(_is_token_chunk(c) for c in data.get("choices") or []):
                    chunks += 1
                    if last is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks
        res.ok = last is not None
        res.error = "" if res.ok else "no content"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def send_whole(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    """A request not streamed: its e2e latency and usage (TTFT is the e2e latency)."""
    res = Result(ok=False, start=time.perf_counter())
    try:
        r = await client.post(url, json=body)
        res.e2e = res.ttft = time.perf_counter() - res.start
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.content[:200]!r}"
            return res
        usage = r.json().get("usage") or {}
        res.prompt_tokens, res.output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        res.ok = res.output_tokens > 0
        res.error = "" if res.ok else "no content"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _is_token_chunk(choice: dict) -> bool:
    """A streamed choice that reports generated tokens (its text may be empty): any completions
    choice; a chat delta that is not the role announcement."""
    return "role" not in (choice.get("delta") or {})


# -- a run ------------------------------------------------------------------------------------------

async def run(base_url: str, body_of, requests: list[Request], concurrency: int | None, rate: float,
              burstiness: float, seed: int, api_key: str | None, endpoint: str) -> tuple[list[Result], float]:
    url = f"{base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or len(requests), 1) + 4)
    gate = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(seed)

    async def one(client, req: Request) -> Result:
        async with gate:
            return await send(client, url, body_of(req))

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        start, tasks = time.perf_counter(), []
        for req in requests:
            tasks.append(asyncio.create_task(one(client, req)))
            if rate != float("inf"):  # Poisson (burstiness 1) or gamma arrivals
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(xs: list[float]) -> dict:
        xs = sorted(x * 1000 for x in xs)
        if not xs:
            return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
        return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
                "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]}

    out_tokens = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
            "mean_prompt_tokens": statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0,
            "mean_output_tokens": out_tokens / len(ok) if ok else 0,
            "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats([r.tpot for r in ok if r.tpot is not None]),
            "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def print_summary(label: str, s: dict) -> None:
    print(f"\n== {label}: {s['completed']} requests ({s['failed']} failed) in {s['duration_s']:.1f} s, "
          f"{s['mean_prompt_tokens']:.0f} prompt / {s['mean_output_tokens']:.0f} output tokens each")
    print(f"   request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s, "
          f"total {s['total_token_throughput']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{name}_ms"]
        print(f"   {name.upper():>4} ms  mean {m['mean']:9.1f}  median {m['median']:9.1f}  p99 {m['p99']:9.1f}")
    for e in s["errors"]:
        print(f"   error: {e}")


# -- launching servers ------------------------------------------------------------------------------

def launch_command(backend: str, port: int, model_dir: str, args: argparse.Namespace,
                   metrics_port: int | None = None) -> list[str]:
    if backend == "kvserve":
        metrics = ["--metrics-export-port", str(metrics_port)] if metrics_port else []
        return [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--model", model_dir,
                "--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
                *metrics, *lora_flags(model_dir, args), *args.kvserve_arg]
    if backend == "transformers":
        exe = Path(sys.executable).with_name("transformers")
        return [str(exe), "serve", model_dir, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning", *args.transformers_arg]
    if backend == "vllm":
        return vllm_cpu.serve_command(args.vllm_venv, model_dir, port, SERVED_NAME, args.max_model_len, args.dtype,
                                      [*lora_flags(model_dir, args), *args.vllm_arg])
    raise ValueError(f"cannot launch {backend}; start it yourself and pass --base-url")


def lora_flags(model_dir: str, args: argparse.Namespace) -> list[str]:
    """--lora-rank: the flags, the same for kvserve and vLLM, that serve its adapter as LORA_NAME."""
    if not args.lora_rank:
        return []
    from benchmarks.random_model import cached_random_adapter

    adapter = cached_random_adapter(Path(model_dir), args.lora_rank)
    return ["--enable-lora", "--max-lora-rank", str(max(16, args.lora_rank)), "--lora-modules", f"{LORA_NAME}={adapter}"]


class Launched:
    """A server subprocess on 127.0.0.1:port, stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, backend: str, port: int, model_dir: str, args: argparse.Namespace) -> None:
        self.log = open(Path(args.log_dir) / f"{backend}.log", "w")
        # kvserve's Ray exports the engine's step counters here (engine_steps reads them)
        self.metrics_port = free_port() if backend == "kvserve" else None
        self.proc = subprocess.Popen(launch_command(backend, port, model_dir, args, self.metrics_port), cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def wait_ready(base_url: str, body: dict, api_key: str | None, proc: subprocess.Popen | None,
                     timeout: float = 600) -> None:
    """Until a one-token completion succeeds (this also warms the server up)."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}; see its log")
            try:
                if (await client.post(f"{base_url}/v1/completions", json=body)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url} not ready after {timeout:.0f} s")
            await asyncio.sleep(2)


# -- main -------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="what --base-url is (sets how outputs are made exact); default: plain OpenAI fields")
    target.add_argument("--model", help="the model name to send (default: the launched server's)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--launch", nargs="+", choices=LAUNCHABLE,
                        help="start these servers here, one after the other, and compare them")
    target.add_argument("--together", action="store_true",
                        help="keep every launched server up for the whole sweep and load them in turn")
    target.add_argument("--rounds", type=int, default=1,
                        help="run the launched servers' sweeps this many times, alternating (default: 1)")
    target.add_argument("--client", choices=["ours", "vllm"], default="ours",
                        help="load generator: this module's, or `vllm bench serve` from --vllm-venv")
    target.add_argument("--model-dir", help="model directory for launched servers (default: the embedded SmolLM2)")
    target.add_argument("--max-model-len", type=int, default=1024, help="launched kvserve's --max-model-len")
    target.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="launched kvserve's and vLLM's --dtype, the same on both (default: %(default)s, "
                             "kvserve's on CPU; vLLM's own default turns a float32 checkpoint into bfloat16)")
    target.add_argument("--kvserve-arg", action="append", default=[], help="extra flag for launched kvserve")
    target.add_argument("--transformers-arg", action="append", default=[],
                        help="extra flag for launched transformers serve")
    target.add_argument("--vllm-venv", type=Path, default=vllm_cpu.DEFAULT_VENV,
                        help="vLLM's CPU build (benchmarks/vllm_cpu.py install; default: %(default)s)")
    target.add_argument("--vllm-arg", action="append", default=[], help="extra flag for launched vllm serve")
    target.add_argument("--lora-rank", type=int, default=0,
                        help="launched kvserve and vLLM serve a random LoRA adapter of this rank, which every "
                             "request names (default: none)")
    target.add_argument("--log-dir", default="/tmp", help="where launched servers' logs go (default: /tmp)")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=32)
    load.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                      help="one run per value: at most this many requests in flight (default: no limit)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s of the arrival process (default: inf, all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    load.add_argument("--random-input-len", type=int, default=128)
    load.add_argument("--random-output-len", type=int, default=64)
    load.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary in [len*(1-r), len*(1+r)]")
    load.add_argument("--prefix-len", type=int, default=0, help="a shared prefix of this many tokens on every prompt")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--no-stream", action="store_true",
                      help="requests with stream: false (our client): TTFT is then the whole reply's latency, no ITL")
    load.add_argument("--tokenizer", help="for building prompts (default: --model-dir or the embedded SmolLM2)")
    p.add_argument("--json-out", help="write every run's summary here")
    args = p.parse_args(argv)
    if not args.base_url and not args.launch:
        p.error("give --base-url or --launch")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.base_url and not args.model:
        p.error("--base-url needs --model")
    return args


@dataclass
class Target:
    label: str
    backend: str
    base_url: str
    model: str
    server: "Launched | None" = None  # None: a server started elsewhere


def load_once(target: Target, conc: int | None, index: int, tokenizer, model_dir: str, args) -> dict:
    """One run of `args.num_prompts` requests at `conc`, with our client or vLLM's."""
    if args.client == "vllm":
        summary = vllm_bench(target, conc, index, model_dir, args)
    else:
        requests = make_requests(tokenizer, args, index)
        results, duration = asyncio.run(run(
            target.base_url, lambda r: request_body(target.backend, args.endpoint, target.model, r, not args.no_stream),
            requests, conc, args.request_rate, args.burstiness, args.seed, args.api_key, args.endpoint))
        summary = summarize(results, duration)
    return {"target": target.label, "max_concurrency": conc, **summary}


def vllm_bench(target: Target, conc: int | None, index: int, model_dir: str, args) -> dict:
    """`vllm bench serve` against the target; its saved JSON in this module's summary shape."""
    out = Path(args.log_dir) / f"vllm-bench-{target.label}-{conc}-{index}.json"
    cmd = [str(vllm_cpu.venv_bin(args.vllm_venv, "vllm")), "bench", "serve", "--backend", "vllm",
           "--base-url", target.base_url, "--model", target.model, "--tokenizer", model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
           "--random-output-len", str(args.random_output_len), "--random-range-ratio", str(args.random_range_ratio),
           "--num-prompts", str(args.num_prompts), "--ignore-eos", "--seed", str(args.seed + index),
           "--request-rate", str(args.request_rate), "--burstiness", str(args.burstiness), "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    if conc:
        cmd += ["--max-concurrency", str(conc)]
    with open(Path(args.log_dir) / "vllm-bench.log", "a") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=args.log_dir)
    r = json.loads(out.read_text())

    def stats(name: str) -> dict:
        return {"mean": r[f"mean_{name}_ms"], "median": r[f"median_{name}_ms"], "p99": r[f"p99_{name}_ms"]}

    return {"completed": r["completed"], "failed": r.get("failed", args.num_prompts - r["completed"]),
            "duration_s": r["duration"], "request_throughput": r["request_throughput"],
            "output_throughput": r["output_throughput"], "total_token_throughput": r["total_token_throughput"],
            "mean_prompt_tokens": r["total_input_tokens"] / max(1, r["completed"]),
            "mean_output_tokens": r["total_output_tokens"] / max(1, r["completed"]),
            "ttft_ms": stats("ttft"), "tpot_ms": stats("tpot"), "itl_ms": stats("itl"), "e2e_ms": stats("e2el"),
            "errors": [e for e in r.get("errors", []) if e][:3]}


STEP_SERIES = re.compile(r'^ray_kvserve_engine_(steps|step_seconds)_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', re.M)
METRICS_LAG_S = 3.0  # the engine's counters reach Ray within 1 s, and Ray's export within 1 s more


def engine_steps(metrics_port: int | None) -> StepTotals | None:
    """kvserve's cumulative engine step counters, {(steps|step_seconds, kind): total}, summed over
    replicas, from its Ray's Prometheus export; None when there is none to read."""
    if metrics_port is None:
        return None
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals: StepTotals = {}
    for name, kind, value in STEP_SERIES.findall(text):
        totals[name, kind] = totals.get((name, kind), 0.0) + float(value)
    return totals


def step_ms(before: StepTotals | None, after: StepTotals | None) -> dict[str, float]:
    """Mean engine step time (ms) by kind between two readings of engine_steps."""
    if before is None or after is None:
        return {}
    return {kind: ms for kind, (_, ms) in step_means(before, after).items()}


def measured_run(target: Target, others: list[Target], conc, index, tokenizer, model_dir, args) -> dict:
    """A run, with the CPU seconds of the target's processes and of the idle `others`, and for a
    launched kvserve its engine's mean step times."""
    roots = [t for t in [target, *others] if t.server is not None]
    before = {t.label: cpu_seconds(t.server.proc.pid) for t in roots}
    metrics_port = target.server.metrics_port if target.server is not None else None
    steps_before = engine_steps(metrics_port)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = load_once(target, conc, index, tokenizer, model_dir, args)
    used = {t.label: cpu_used(before[t.label], cpu_seconds(t.server.proc.pid)) for t in roots}
    if steps_before is not None:
        time.sleep(METRICS_LAG_S)
        summary["engine_step_ms"] = step_ms(steps_before, engine_steps(metrics_port))
    summary["loadavg_1m_before"] = load
    summary["cpu_s"] = used.get(target.label, {})
    summary["idle_peers_cpu_s"] = {k: round(sum(v.values()), 1) for k, v in used.items() if k != target.label}
    print_summary(f"{target.label}, concurrency {conc or 'unlimited'}", summary)
    return summary


def launch(backend: str, model_dir: str, args) -> Target:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = (LORA_NAME if args.lora_rank else SERVED_NAME) if backend in ("kvserve", "vllm") else model_dir
    server = Launched(backend, port, model_dir, args)
    print(f"\nstarting {backend} on {url} (log: {args.log_dir}/{backend}.log) ...", flush=True)
    try:
        asyncio.run(wait_ready(url, {"model": model, "prompt": "Hi", "max_tokens": 1}, args.api_key, server.proc))
    except BaseException:
        server.__exit__()
        raise
    return Target(backend, backend, url, model, server)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    model_dir = str(resolve_model(args.model_dir))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    info = machine_info()
    print_machine(info)
    rows = []
    concs = list(enumerate(args.max_concurrency))

    def runs(targets: list[Target], rnd: int) -> None:
        for i, conc in concs:  # run i of a sweep has its own prompts, whichever server and round
            for t in targets:
                rows.append({"round": rnd, **measured_run(t, [o for o in targets if o is not t], conc, i,
                                                           tokenizer, model_dir, args)})

    if args.base_url:
        runs([Target(args.backend, args.backend, args.base_url.rstrip("/"), args.model)], 0)
    launched = args.launch or []
    if args.together and launched:
        targets = []
        try:
            for backend in launched:
                targets.append(launch(backend, model_dir, args))
            for rnd in range(args.rounds):
                runs(targets, rnd)
        finally:
            for t in targets:
                t.server.__exit__()
    else:
        for rnd in range(args.rounds if launched else 0):
            for backend in launched:
                target = launch(backend, model_dir, args)
                try:
                    runs([target], rnd)
                finally:
                    target.server.__exit__()
    print_table(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": info, "args": vars(args) | {"request_rate": str(
            args.request_rate)}, "runs": rows}, indent=2, default=str))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def print_table(rows: list[dict]) -> None:
    headers = ["target", "conc", "round", "load", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean",
               "ITL p99", "E2E p99", "CPU s"]
    table = [[r["target"], r["max_concurrency"] or "inf", r.get("round", 0), f"{r.get('loadavg_1m_before', 0):.1f}",
              f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}", f"{r['ttft_ms']['mean']:.0f}",
              f"{r['ttft_ms']['p99']:.0f}", f"{r['tpot_ms']['mean']:.0f}", f"{r['itl_ms']['p99']:.0f}",
              f"{r['e2e_ms']['p99']:.0f}", f"{sum(r.get('cpu_s', {}).values()):.0f}"] for r in rows]
    print("\n(latencies in ms; load: 1-minute load average before the run; CPU s: the server's processes)\n"
          + markdown_table(headers, table))
    for r in rows:
        if r.get("cpu_s"):
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["cpu_s"].items())[:6])
            print(f"CPU s, {r['target']} at {r['max_concurrency']} (round {r.get('round', 0)}): {top}; "
                  f"idle peers {r['idle_peers_cpu_s']}")
        if r.get("engine_step_ms"):
            ms = ", ".join(f"{k} {v:.1f}" for k, v in r["engine_step_ms"].items())
            print(f"engine step ms, {r['target']} at {r['max_concurrency']} (round {r.get('round', 0)}): {ms}")
    by = {(r["target"], r["max_concurrency"], r.get("round", 0)): r for r in rows}
    for (target, conc, rnd), r in by.items():
        for peer_name in ("vllm", "transformers"):
            peer = by.get((peer_name, conc, rnd))
            if target == "kvserve" and peer and peer["output_throughput"]:
                print(f"concurrency {conc}, round {rnd}: kvserve / {peer_name} output tok/s = "
                      f"{r['output_throughput'] / peer['output_throughput']:.2f}x, P99 TTFT = "
                      f"{r['ttft_ms']['p99']:.0f} vs {peer['ttft_ms']['p99']:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
