"""Fit the simulator's cost model to a real engine's measured step times.

    python -m cluster.sim fit --model DIR [--device cuda] [--out cost.json]

runs batches of synthetic requests (several prompt lengths and batch sizes) through
`engine.LLMEngine`, times every model execution (`executor.execute`, i.e. without the
scheduler's own CPU time, which the simulator runs for real), and least-squares fits
step_s = a + b * batched_tokens + c * context_tokens. The simulator reads the JSON with
--cost-model.
"""
from __future__ import annotations

import argparse
import random
import time

from cluster.sim.cost import batch_features, fit


def measure_engine(engine, shapes: list[tuple[int, int, int]], seed: int = 0) -> list[tuple[int, int, float]]:
    """Samples (batched_tokens, context_tokens, seconds), one per model step, for each
    (num_requests, prompt_len, max_tokens) shape run to completion on `engine`."""
    from engine.sampling_params import SamplingParams

    samples: list[tuple[int, int, float]] = []
    execute = engine.executor.execute

    def timed(batch):
        features = batch_features(batch)  # before the step's bookkeeping advances the sequences
        t0 = time.perf_counter()
        out = execute(batch)
        samples.append((*features, time.perf_counter() - t0))
        return out

    engine.executor.execute = timed
    rng = random.Random(seed)
    vocab = engine.executor.info.vocab_size
    try:
        for k, (n, prompt_len, max_tokens) in enumerate(shapes):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
            for i in range(n):
                engine.add_request(f"fit{k}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.executor.execute = execute
    return samples


DEFAULT_SHAPES = [(1, 32, 16), (4, 128, 16), (16, 64, 32), (2, 512, 8), (8, 256, 16), (32, 32, 32)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.sim fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--warmup", type=int, default=1, help="shapes run first and not measured (default: 1)")
    p.add_argument("--out", default="cost.json", help="where to write the fitted cost model (default: cost.json)")
    args = p.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_model_len=2048))
    measure_engine(engine, DEFAULT_SHAPES[:args.warmup])
    samples = measure_engine(engine, DEFAULT_SHAPES, seed=1)
    model = fit(samples, name=f"fitted:{args.model or 'SmolLM2-135M'}:{args.device}")
    model.save(args.out)
    print(f"{len(samples)} steps -> a={model.a:.3g}s b={model.b:.3g}s/token c={model.c:.3g}s/context-token; "
          f"wrote {args.out}")
    return 0

