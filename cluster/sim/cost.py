"""Step time of one engine replica as a function of the scheduled batch.

    step_s = a + b * batched_tokens + c * context_tokens

    a               fixed cost per step: reading the weights once (decode is memory bound), launches
    b               per new token: the matmuls (prefill is compute bound)
    c               per token of attention context, summed over the scheduled sequences
                    (KV reads for decodes, the attention span of prefill chunks)

`fit` estimates (a, b, c) by least squares from measured (batched tokens, context tokens,
seconds) samples; `measure_engine` produces such samples from a real `LLMEngine`
(python -m cluster.sim.fit --model DIR writes a JSON the simulator reads with --cost-model).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class CostModel:
    # Defaults: roughly an 8B Llama in bf16 on one 24 GB GPU (A10G class: ~600 GB/s, ~125 TFLOP/s),
    # from rooflines: 16 GB of weights per step at ~600 GB/s; 16 GFLOP per token at ~50% of peak;
    # 128 KB of KV per context token at ~600 GB/s.
    a: float = 0.025  # seconds per step
    b: float = 1.5e-4  # seconds per batched (new) token
    c: float = 2.0e-7  # seconds per context token of the scheduled sequences
    name: str = "8b-24gb-roofline"

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0 or self.a + self.b <= 0:
            raise ValueError(f"cost model coefficients must be >= 0 and not all zero, got {self}")

    def step_time(self, batched_tokens: int, context_tokens: int) -> float:
        return self.a + self.b * batched_tokens + self.c * context_tokens

    def batch_time(self, batch: ScheduledBatch) -> float:
        """Call before the step's bookkeeping advances num_computed_tokens."""
        ctx = sum(s.num_computed_tokens for s in batch.seqs) + batch.num_tokens
        return self.step_time(batch.num_tokens, ctx)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls(**json.loads(Path(path).read_text()))


def batch_features(batch: ScheduledBatch) -> tuple[int, int]:
    """(batched tokens, context tokens) of a batch, before its bookkeeping."""
    return batch.num_tokens, sum(s.num_computed_tokens for s in batch.seqs) + batch.num_tokens


def fit(samples: list[tuple[int, int, float]], name: str = "fitted") -> CostModel:
    """Least squares over (batched_tokens, context_tokens, seconds), coefficients clipped at 0
    (a negative one is refitted without its feature)."""
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"need at least 3 samples to fit 3 coefficients, got {len(samples)}")
    data = np.asarray(samples, dtype=np.float64)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for i, v in zip(active, coef):
        full[i] = max(0.0, float(v))
    return CostModel(*full, name=name)
