"""What the serving path costs per token: `kvserve serve` with a model-free, paced engine.

    python benchmarks/serving_overhead.py --max-concurrency 16 --num-prompts 64
    python benchmarks/serving_overhead.py --env RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 ...
    python benchmarks/serving_overhead.py --no-stream     # replies sent whole

The server is the real one (Serve proxy, ingress, request router, engine replica) with
benchmarks.paced_engine.PacedEngine in the replica: every running request gets a token each
KVSERVE_PACED_STEP_S (--step-s). Streamed load as in benchmarks/serve.py, or with --no-stream
replies sent whole (the engine then hands out a request's first and last outputs only). Reported: each
process's CPU milliseconds per output token (from /proc), which, unlike throughput, hardly
depends on what else the host runs. `--env` settings reach every Ray process of the server
(they are in the driver's environment when it starts Ray).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table  # noqa: E402
from benchmarks.proc_cpu import cpu_seconds, cpu_used  # noqa: E402
from benchmarks.serve import Launched, Request, free_port, request_body, run, summarize, wait_ready  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-s", type=float, default=0.1, help="the paced engine's step time (default: 0.1)")
    p.add_argument("--no-stream", action="store_true", help="requests with stream: false")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the server's processes")
    p.add_argument("--kvserve-arg", action="append", default=[], help="extra flag for kvserve serve")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--py-spy", metavar="DIR", help="also profile the proxy, ingress and replica during the load "
                                                   "(py-spy record, raw folded stacks into DIR)")
    args = p.parse_args(argv)
    for kv in args.env:
        key, _, value = kv.partition("=")
        os.environ[key] = value
    os.environ["KVSERVE_PACED_STEP_S"] = str(args.step_s)
    launch_args = argparse.Namespace(log_dir=args.log_dir, max_model_len=1024, dtype="float32", kvserve_arg=[
        "--engine-cls", "benchmarks.paced_engine:PacedEngine", *args.kvserve_arg])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    from engine.model_source import resolve_model  # the model's config sizes the app; no weights load

    with Launched("kvserve", port, str(resolve_model(None)), launch_args) as server:
        asyncio.run(wait_ready(url, {"model": "bench", "prompt": "Hi", "max_tokens": 1}, None, server.proc))
        requests = [Request(" ".join(["hello"] * 32), args.output_len) for _ in range(args.num_prompts)]
        before = cpu_seconds(server.proc.pid)
        spies = profile(before, args.py_spy) if args.py_spy else []
        results, duration = asyncio.run(run(url, lambda r: request_body("kvserve", "completions", "bench", r,
                                                                              not args.no_stream),
                                            requests, args.max_concurrency, float("inf"), 1.0, 0, None,
                                            "completions"))
        used = cpu_used(before, cpu_seconds(server.proc.pid))
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    s = summarize(results, duration)
    tokens = sum(r.output_tokens for r in results if r.ok)
    print(f"{s['completed']} requests ({s['failed']} failed) in {duration:.1f} s: {s['output_throughput']:.1f} tok/s, "
          f"TTFT p99 {s['ttft_ms']['p99']:.0f} ms, ITL mean {s['itl_ms']['mean']:.1f} ms; load "
          f"{os.getloadavg()[0]:.1f}; env {args.env or 'default'}{'; not streamed' if args.no_stream else ''}")
    rows = [[name, f"{sec:.2f}", f"{1000 * sec / max(tokens, 1):.2f}", f"{100 * sec / duration:.1f}"]
            for name, sec in used.items() if sec >= 0.05]
    total = sum(used.values())
    rows.append(["total", f"{total:.2f}", f"{1000 * total / max(tokens, 1):.2f}", f"{100 * total / duration:.1f}"])
    print(markdown_table(["process", "CPU s", "CPU ms / token", "% of a core"], rows))
    return 0 if s["failed"] == 0 else 1


def profile(procs: dict[int, tuple[str, float]], out_dir: str) -> list[subprocess.Popen]:
    """py-spy on the server's Serve processes until stopped (SIGINT writes the profile)."""
    py_spy = Path(sys.executable).with_name("py-spy")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([str(py_spy), "record", "-p", str(pid), "-f", "raw", "--nonblocking", "-r", "50",
                              "-o", f"{out_dir}/{name}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for pid, (name, _) in procs.items() if name in ("ProxyActor", "OpenAIIngress", "EngineServer")]


if __name__ == "__main__":
    sys.exit(main())
