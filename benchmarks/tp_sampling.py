"""tp=2 output tok/s on a tiny random Llama with a 49,152-token vocabulary, where every step's
sampled rows once crossed Ray as full float32 logits. Run it against two checkouts:

    PYTHONPATH=CHECKOUT python benchmarks/tp_sampling.py CHECKOUT
"""
import sys, time, random
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.tiny_llama import make_tiny_llama
from engine import LLM, SamplingParams
d = Path("/tmp/tpbench/model")
if not (d / "config.json").exists():
    make_tiny_llama(d, "/root/.cache/kvserve/models/SmolLM2-135M-Instruct", "gqa", vocab_size=49152)
llm = LLM(model=str(d), tensor_parallel_size=2, num_gpu_blocks_override=512, device="cpu")
rng = random.Random(0)
prompts = [[rng.randrange(3, 49000) for _ in range(32)] for _ in range(16)]
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
best = 0
for _ in range(3):
    t = time.perf_counter(); outs = llm.generate(prompts, p, use_tqdm=False); dt = time.perf_counter() - t
    best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
print(f"{sys.argv[1]}: tp=2 output tok/s (best of 3): {best:.1f}")
llm.llm_engine.executor.shutdown() if hasattr(llm, "llm_engine") else None
