"""Cross-encoder reranking throughput: kvserve's `LLM.score` on a classifier against HF
transformers scoring the same pairs as sentence-transformers' CrossEncoder does (the pairs
tokenized together, padded batches through AutoModelForSequenceClassification), in one run.

    python benchmarks/rerank.py                                   # 16 queries x 32 documents
    python benchmarks/rerank.py --queries 4 --docs 64 --hf-batch-size 16

The model: the embedded SmolLM2-135M made a reranker as Qwen3-Reranker is served (vLLM's
`--hf-overrides`, engine.hf_overrides): its head rows of "no" and "yes" make a one-label head,
and a pair is its two texts joined. Real weights, so real compute; its scores mean little.
Inputs: seeded random sentences over a fixed word list, --query-words and --doc-words long.
Reported: pairs/s and prompt tokens/s of each, kvserve against HF, and the largest |difference|
of their scores (float32 weights and arithmetic in both: the same function).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, markdown_table, print_machine  # noqa: E402

RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
WORDS = ("the capital city river mountain France Paris bank account money market cell energy light sound "
         "history war peace law court judge train station music song art paint garden tree water fire "
         "computer program memory cache model language number system network server request block").split()


def sentences(n: int, words: tuple[int, int], rng: random.Random, prefix: str) -> list[str]:
    return [prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + "\n" for _ in range(n)]


def hf_scores(model_dir: str, tokenizer, prompts: list[list[int]], batch_size: int) -> tuple[list[float], float]:
    """CrossEncoder.predict's way, batches sorted by length (its best case): -> (sigmoid scores, seconds)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from safetensors.torch import load_file

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.score.weight.data = load_file(f"{model_dir}/score.safetensors")["score.weight"]  # HF reads model.safetensors
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.config.pad_token_id = pad
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [0.0] * len(prompts)

    def run(indices: list[int]) -> None:
        width = max(len(prompts[i]) for i in indices)
        ids = torch.full((len(indices), width), pad, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            ids[row, :len(prompts[i])], mask[row, :len(prompts[i])] = torch.tensor(prompts[i]), 1
        with torch.inference_mode():
            h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = h[torch.arange(len(indices)), mask.sum(1) - 1]  # each pair's last real token
            for i, s in zip(indices, torch.sigmoid(model.score(last)[:, 0]).tolist()):
                out[i] = s

    run(order[:2])  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        run(order[start:start + batch_size])
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--docs", type=int, default=32, help="documents per query")
    p.add_argument("--query-words", type=int, nargs=2, default=(4, 12))
    p.add_argument("--doc-words", type=int, nargs=2, default=(30, 150))
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from engine import LLM
    from engine.model_source import model_dir

    rng = random.Random(args.seed)
    queries = sentences(args.queries, args.query_words, rng, "<Query>: ")
    docs = [sentences(args.docs, args.doc_words, rng, "<Document>: ") for _ in queries]
    print(f"{args.queries} queries x {args.docs} documents", file=sys.stderr)
    llm = LLM(None, hf_overrides=RERANKER)
    folder = model_dir(llm.engine.config)
    llm.score(queries[0], docs[0][:4], use_tqdm=False)  # warm-up
    firsts = [q for q, per_query in zip(queries, docs) for _ in per_query]
    t0 = time.perf_counter()
    outs = llm.score(firsts, [d for per_query in docs for d in per_query], use_tqdm=False)  # N:N, one batch
    ours_s = time.perf_counter() - t0
    ours, prompts = [o.outputs.score for o in outs], [o.prompt_token_ids for o in outs]
    del llm
    theirs, hf_s = hf_scores(str(folder), _tokenizer(folder), prompts, args.hf_batch_size)
    tokens = sum(map(len, prompts))
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    rows = [["kvserve LLM.score", f"{len(prompts) / ours_s:.1f}", f"{tokens / ours_s:,.0f}", f"{hf_s / ours_s:.2f}x",
             f"{diff:.1e}"],
            [f"HF (batches of {args.hf_batch_size})", f"{len(prompts) / hf_s:.1f}", f"{tokens / hf_s:,.0f}", "1.00x", "-"]]
    print_machine(machine_info())
    print(f"{len(prompts)} pairs, {tokens:,} prompt tokens (mean {tokens / len(prompts):.0f})")
    print(markdown_table(["system", "pairs/s", "prompt tok/s", "vs HF", "max |score diff|"], rows))
    return 0


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


if __name__ == "__main__":
    sys.exit(main())
