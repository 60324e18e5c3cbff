"""Plot a `benchmarks/serve.py --json-out` file: output tok/s and P99 TTFT per concurrency.

    python benchmarks/plot_serve.py results.json docs/serve.png
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, out = argv
    runs = json.load(open(src))["runs"]
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for target in dict.fromkeys(r["target"] for r in runs):
        mine = sorted((r for r in runs if r["target"] == target), key=lambda r: r["max_concurrency"] or 0)
        conc = [r["max_concurrency"] for r in mine]
        ax_tput.plot(conc, [r["output_throughput"] for r in mine], marker="o", label=target)
        ax_ttft.plot(conc, [r["ttft_ms"]["p99"] / 1000 for r in mine], marker="o", label=target)
    for ax, title in ((ax_tput, "output tokens/s"), (ax_ttft, "P99 TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
