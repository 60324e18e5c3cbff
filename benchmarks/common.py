"""Helpers shared by the benchmarks: what machine ran them, markdown tables of results, and the
engine's mean step times between two readings of its step counters."""
from __future__ import annotations

import os
import platform
import socket
import sys


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU, cores, accelerator and library versions: enough to tell two runs' machines apart."""
    import torch
    import transformers

    info = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def print_machine(info: dict, file=sys.stdout) -> None:
    gpu = f", GPU {info['gpu']}" if info["gpu"] else ""
    print(f"machine: {info['cpu']} ({info['usable_cores']} of {info['logical_cores']} cores usable){gpu}", file=file)
    print(f"python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), "
          f"transformers {info['transformers']}", file=file)


STEP_KINDS = ("prefill", "decode")
StepTotals = dict[tuple[str, str], float]  # ("steps" | "step_seconds", kind) -> cumulative total


def step_totals(stats) -> StepTotals:
    """An EngineStats' step counters as StepTotals."""
    return {(name, kind): getattr(stats, f"{kind}_{name}") for name in ("steps", "step_seconds") for kind in STEP_KINDS}


def step_means(before: StepTotals, after: StepTotals) -> dict[str, tuple[float, float]]:
    """{kind: (steps, mean step ms)} between two readings, for the kinds that stepped in between."""
    out = {}
    for kind in STEP_KINDS:
        steps = after.get(("steps", kind), 0.0) - before.get(("steps", kind), 0.0)
        if steps > 0:
            seconds = after.get(("step_seconds", kind), 0.0) - before.get(("step_seconds", kind), 0.0)
            out[kind] = (steps, 1e3 * seconds / steps)
    return out


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """Rows of already formatted cells; numbers are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]  # no rows: the headers'
    numeric = [all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w)
                                 for c, w, num in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if num else "-" * (w + 2) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def _is_number(cell: str) -> bool:
    try:
        float(cell.rstrip("x"))
        return True
    except ValueError:
        return False
