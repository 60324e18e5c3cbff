"""python -m cluster.sim [run] ... | sweep ... | fit ...

    run     one workload, each policy: P50/P99 TTFT, TPOT, throughput, preemptions, prefix hits
    sweep   workloads at rising load: a markdown table on stdout, one PNG per workload (--json: the results)
    report  tables and plots again from sweep --json files
    fit     measure a real engine's step times and fit the cost model (cluster/sim/fit.py)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from cluster.policy import ROUTERS, KVPolicyConfig
from cluster.sim.cost import CostModel
from cluster.sim.floor import floor_p99
from cluster.sim.metrics import SimResult, comparison_table, markdown_table
from cluster.sim.replica import ReplicaConfig
from cluster.sim.simulation import SimConfig, simulate
from cluster.sim.workload import WorkloadConfig, generate

# Per workload: WorkloadConfig fields. prompt_mean is the suffix / user message where there is a
# shared prefix (prefix_len tokens, from --prefix-len unless set here).
PRESETS = {
    "shared-prefix": dict(kind="shared-prefix", prompt_mean=128, output_mean=128),
    "no-prefix": dict(kind="no-prefix", prompt_mean=1024, output_mean=256),
    # 4 hot system prompts carry 80% of the requests; the rest spread over 16 per replica, Zipf.
    "skewed": dict(kind="skewed", prompt_mean=128, output_mean=128, num_hot=4, hot_share=0.8),
    # chat sessions of ~6 turns, 8 system prompts of 512 tokens, user turns ~128, answers ~192.
    "multi-turn": dict(kind="multi-turn", prompt_mean=128, output_mean=192, num_groups=8, prefix_len=512),
    # shared-prefix traffic with a 10 s burst at 4x the base rate, from t = 10 s.
    "burst": dict(kind="shared-prefix", prompt_mean=128, output_mean=128, bursts=((10.0, 10.0, 4.0),)),
}
SWEEP_LOADS = {"shared-prefix": (2, 4, 6), "no-prefix": (1, 2, 2.5),  # req/s per replica
               "skewed": (2, 4, 6), "multi-turn": (1, 3, 5), "burst": (3,)}


def _burst(text: str) -> tuple[float, float, float]:
    try:
        start, length, mult = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a burst is START:LENGTH:MULTIPLIER (seconds, seconds, x), got {text!r}")
    return start, length, mult


def _policies(text: str) -> list[str]:
    if text == "all":
        return list(ROUTERS)
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in ROUTERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"policies must be a comma list of {', '.join(ROUTERS)}, got {text!r}")
    return names


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=8, help="simulated engine replicas (default: 8)")
    p.add_argument("--policies", type=_policies, default=["kv", "pow2", "round_robin"],
                   help=f"comma list of {','.join(ROUTERS)}, or all (default: kv,pow2,round_robin; sweep: all)")
    p.add_argument("--duration", type=float,
                   help="seconds of arrivals (default: 30; with more than 64 replicas 30 * 64 / replicas, >= 8)")
    p.add_argument("--warmup", type=float, default=5.0, help="arrivals before this are not measured (default: 5)")
    p.add_argument("--stats-interval", type=float, default=0.5, help="seconds between replica reports (default: 0.5)")
    p.add_argument("--groups-per-replica", type=float, default=2.0,
                   help="shared-prefix groups per replica (default: 2)")
    p.add_argument("--prefix-len", type=int, default=1536, help="shared-prefix tokens (default: 1536)")
    p.add_argument("--prompt-mean", type=int, help="mean prompt (no-prefix) or suffix tokens (default: per workload)")
    p.add_argument("--output-mean", type=int, help="mean output tokens (default: per workload)")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson)")
    p.add_argument("--burst", type=_burst, action="append", default=[], metavar="START:LEN:MULT",
                   help="multiply the rate inside a window (repeatable)")
    p.add_argument("--cost-model", help="JSON from `python -m cluster.sim fit` (default: 8B on a 24 GB GPU)")
    p.add_argument("--num-blocks", type=int, default=ReplicaConfig.num_blocks, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=ReplicaConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=ReplicaConfig.max_num_batched_tokens)
    p.add_argument("--max-queue", type=int, default=1_000_000, help="requests held at the router before rejecting")
    p.add_argument("--max-ongoing", type=int,
                   help="requests in flight per replica before the router holds them, every policy but kv "
                        "(default: max-num-seqs for pow2/round_robin, none for the peers, as they deploy)")
    p.add_argument("--load-weight", type=float, default=KVPolicyConfig.load_weight, help="kv: see cluster/policy.py")
    p.add_argument("--request-weight", type=float, default=KVPolicyConfig.request_weight,
                   help="kv: prompt tokens one request in flight costs (see cluster/policy.py)")
    p.add_argument("--session-weight", type=float, default=KVPolicyConfig.session_weight,
                   help="kv: what a request in flight costs a session's first request (see cluster/policy.py)")
    p.add_argument("--prefill-rate", type=float,
                   help="kv: prompt tokens/s a replica prefills (default: the cost model's, 0.9 / b)")
    p.add_argument("--held-order", choices=["affinity", "fifo"], default=KVPolicyConfig.held_order,
                   help="kv: which held request takes room that opens (default: affinity, see cluster/policy.py)")
    p.add_argument("--max-hold", type=float, default=KVPolicyConfig.max_hold_s,
                   help="kv, affinity: seconds after which the oldest held request goes first")
    p.add_argument("--ttft-slo", type=float, default=SimConfig.ttft_slo_s,
                   help="goodput: a request meets the SLO when its first token came within this (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prewarm", action="store_true",
                   help="every replica starts holding every shared prefix (what routing could reach with no cold prefix)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def sim_config(args) -> SimConfig:
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    replica = ReplicaConfig(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    rate = args.prefill_rate if args.prefill_rate is not None else round(0.9 / cost.b) if cost.b > 0 else 0.0
    kv = KVPolicyConfig(load_weight=args.load_weight, request_weight=args.request_weight,
                        session_weight=args.session_weight, prefill_rate=rate,
                        held_order=args.held_order, max_hold_s=args.max_hold, ttft_slo_s=args.ttft_slo)
    return SimConfig(num_replicas=args.replicas, replica=replica, cost=cost, stats_interval_s=args.stats_interval,
                     max_queue=args.max_queue, max_ongoing=args.max_ongoing, warmup_s=args.warmup, kv=kv,
                     ttft_slo_s=args.ttft_slo, seed=args.seed, prewarm=args.prewarm)


def workload_config(args, workload: str, rate: float) -> WorkloadConfig:
    preset = dict(PRESETS[workload])
    duration = args.duration or (30.0 if args.replicas <= 64 else max(8.0, 30.0 * 64 / args.replicas))
    groups = max(1, round(args.groups_per_replica * args.replicas))
    if preset["kind"] == "skewed":
        groups = max(preset["num_hot"] + 1, 16 * args.replicas)  # the long tail
    fields = dict(num_groups=groups, prefix_len=args.prefix_len) | preset
    fields["bursts"] = tuple(args.burst) or fields.get("bursts", ())
    if args.prompt_mean:
        fields["prompt_mean"] = args.prompt_mean
    if args.output_mean:
        fields["output_mean"] = args.output_mean
    return WorkloadConfig(rate=rate, duration_s=duration, cv=args.cv, seed=args.seed, **fields)


def _run_one(job: tuple) -> SimResult:
    wl_cfg, policy, cfg, progress = job
    return simulate(generate(wl_cfg), policy, cfg, progress=progress)


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.sim", description="Simulate routing policies on N replicas.")
    p.add_argument("--workload", choices=list(PRESETS), default="shared-prefix")
    p.add_argument("--rate", type=float, help="requests per second, whole cluster (default: 3 per replica)")
    add_common(p)
    args = p.parse_args(argv)
    cfg = sim_config(args)
    wl_cfg = workload_config(args, args.workload, args.rate or 3.0 * args.replicas)
    workload = generate(wl_cfg)
    print(f"{args.workload}: {len(workload)} requests at {wl_cfg.rate:g}/s over {wl_cfg.duration_s:g}s on "
          f"{args.replicas} replicas (cost model {cfg.cost.name})", file=sys.stderr)
    results = []
    for policy in args.policies:
        t0 = time.process_time()
        results.append(simulate(workload, policy, cfg, progress=not args.quiet))
        if not args.quiet:
            print(f"  {policy}: {time.process_time() - t0:.1f}s CPU", file=sys.stderr)
    print(markdown_table(results))
    return 0


def sweep(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.sim sweep",
                                description="Workloads at rising load: markdown table + one PNG per workload.")
    p.add_argument("--workloads", default=",".join(PRESETS))
    p.add_argument("--loads", help="requests/s per replica, comma list (default: per workload)")
    p.add_argument("--out", default="docs/sim", help="PNG path prefix: <out>_<workload>.png (default: docs/sim)")
    p.add_argument("--json", help="also write every result here, for `python -m cluster.sim report`")
    p.add_argument("--jobs", type=int, default=1, help="parallel simulations (processes)")
    add_common(p)
    p.set_defaults(replicas=64, policies=list(ROUTERS))
    args = p.parse_args(argv)
    cfg = sim_config(args)
    rows = []
    for kind in args.workloads.split(","):
        loads = [float(x) for x in args.loads.split(",")] if args.loads else SWEEP_LOADS[kind]
        jobs = [(workload_config(args, kind, load * args.replicas), pol, cfg, False)
                for load in loads for pol in args.policies]
        t0 = time.time()
        results = _map(jobs, args.jobs, quiet=args.quiet, label=kind)
        pairs = list(zip([load for load in loads for _ in args.policies], results))
        floors = {load: floor_p99(generate(workload_config(args, kind, load * args.replicas)), cfg.cost,
                                  cfg.replica.block_size, cfg.replica.max_num_batched_tokens, cfg.warmup_s)
                  for load in loads}
        rows += [dict(workload=kind, load=load, floor_p99=floors[load], **dataclasses.asdict(r)) for load, r in pairs]
        print(f"\n### {kind}, {args.replicas} replicas ({time.time() - t0:.0f}s)\n")
        print(markdown_table([r for _, r in pairs], {"load req/s/replica": [f"{l:g}" for l, _ in pairs]}))
        _print_comparisons(kind, pairs, floors, cfg.ttft_slo_s)
        path = f"{args.out}_{kind}.png"
        if plot(pairs, kind, args.replicas, path):
            print(f"\nwrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=0) + "\n")
    return 0


def _print_comparisons(kind: str, pairs: list[tuple[float, SimResult]], floors: dict[float, float], slo: float) -> None:
    print(f"\nP99 TTFT (s), {kind} (floor: the P99 no router can beat, cluster/sim/floor.py):\n")
    print(comparison_table(pairs, "ttft_p99", floors=floors))
    print(f"\nShare of requests with TTFT <= {slo:g} s, {kind}:\n")
    print(comparison_table(pairs, "slo_met", "{:.1%}", lower_is_better=False))


def report(argv: list[str]) -> int:
    """Tables and plots from `sweep --json` files; a later file's (workload, load, policy) wins."""
    p = argparse.ArgumentParser(prog="python -m cluster.sim report",
                                description="Tables and plots from sweep --json files (later files win).")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default="docs/sim", help="PNG path prefix: <out>_<workload>.png")
    p.add_argument("--ttft-slo", type=float, default=SimConfig.ttft_slo_s)
    args = p.parse_args(argv)
    merged: dict[tuple, dict] = {}
    for f in args.files:
        for row in json.loads(Path(f).read_text()):
            merged[(row["workload"], row["load"], row["policy"])] = row
    order = {name: i for i, name in enumerate(ROUTERS)}
    fields = {f.name for f in dataclasses.fields(SimResult)}
    for kind in dict.fromkeys(k[0] for k in merged):
        rows = sorted((r for k, r in merged.items() if k[0] == kind), key=lambda r: (r["load"], order[r["policy"]]))
        pairs = [(r["load"], SimResult(**{k: v for k, v in r.items() if k in fields})) for r in rows]
        floors = {r["load"]: r["floor_p99"] for r in rows}
        print(f"\n### {kind}, {pairs[0][1].num_replicas} replicas\n")
        print(markdown_table([r for _, r in pairs], {"load req/s/replica": [f"{l:g}" for l, _ in pairs]}))
        _print_comparisons(kind, pairs, floors, args.ttft_slo)
        path = f"{args.out}_{kind}.png"
        if plot(pairs, kind, pairs[0][1].num_replicas, path):
            print(f"\nwrote {path}")
    return 0


def _map(jobs: list[tuple], n: int, quiet: bool, label: str) -> list[SimResult]:
    done = []
    if n > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(n) as pool:
            for i, r in enumerate(pool.imap(_run_one, jobs)):
                done.append(r)
                if not quiet:
                    print(f"\r  {label}: {i + 1}/{len(jobs)} runs", end="", file=sys.stderr, flush=True)
    else:
        for i, job in enumerate(jobs):
            done.append(_run_one(job))
            if not quiet:
                print(f"\r  {label}: {i + 1}/{len(jobs)} runs", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)
    return done


def plot(pairs: list[tuple[float, SimResult]], kind: str, replicas: int, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    panels = [("ttft_p99", "P99 TTFT (s)", True), ("ttft_p50", "P50 TTFT (s)", True),
              ("throughput_tok_s", "output tokens/s", False), ("slo_met", "share with TTFT within the SLO", False)]
    for ax, (field, label, log) in zip(axes, panels):
        for policy in dict.fromkeys(r.policy for _, r in pairs):
            xs = [l for l, r in pairs if r.policy == policy]
            ys = [getattr(r, field) for _, r in pairs if r.policy == policy]
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("offered load (requests/s per replica)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"kvserve cluster simulator: {kind}, {replicas} replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sweep":
        return sweep(argv[1:])
    if argv and argv[0] == "report":
        return report(argv[1:])
    if argv and argv[0] == "fit":
        from cluster.sim.fit import main as fit_main
        return fit_main(argv[1:])
    return run(argv[1:] if argv and argv[0] == "run" else argv)


if __name__ == "__main__":
    sys.exit(main())

