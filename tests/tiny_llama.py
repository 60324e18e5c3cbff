"""Tiny random Llama-family checkpoints written to safetensors, plus the HF greedy oracle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_CONFIGS = {
    # GQA 4 heads / 2 KV heads, untied lm_head
    "gqa": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False),
    # 6 heads / 3 KV heads (not divisible by 2), tied embeddings, llama3 rope scaling
    "tied": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=3, tie_word_embeddings=True,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen3: q/k RMSNorms per head, head_dim 32 where hidden / heads is 16, tied embeddings
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    # Llama with attention_bias (q/k/v and o_proj) and mlp_bias: every linear has a bias
    "bias": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # Qwen2: q/k/v biases always, o_proj's never (whatever attention_bias says)
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Mistral over a sliding window of 128 tokens (served with contexts capped at the window)
    "mistral-swa": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, sliding_window=128, tie_word_embeddings=False),
}


def make_tiny_llama(out_dir: Path, tokenizer_dir: str, kind: str = "gqa", vocab_size: int = 512, seed: int = 0) -> Path:
    """kind: a TINY_CONFIGS key, or one with "-gguf" appended: the same model with its weights as
    a GGUF Q4_1 file dequantizes them (Q8_0 for the embedding), as the embedded SmolLM2's are; or
    with "-bf16": saved in bfloat16, as most checkpoints are ("-fp16": in float16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = kind.removesuffix("-gguf").removesuffix("-bf16").removesuffix("-fp16")
    gguf_weights = kind.endswith("-gguf")
    params = dict(TINY_CONFIGS[config])
    cfg = AutoConfig.for_model(params.pop("model_type", "llama"), vocab_size=vocab_size, max_position_embeddings=1024,
                               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **params)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger weights than the default init give peaky, tie-free logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
                if gguf_weights:
                    p.copy_(gguf_roundtrip(p, "Q8_0" if "embed" in name else "Q4_1"))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones: a weight read wrongly shows
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # not HF's zeros, for the same reason
                p.normal_(0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind.endswith(("-bf16", "-fp16")):
        model = model.to(torch.bfloat16 if kind.endswith("-bf16") else torch.float16)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return out_dir


def make_tiny_classifier(src_dir: Path, out_dir: Path, num_labels: int, seed: int = 1, **config) -> Path:
    """A `...ForSequenceClassification` checkpoint (engine.classifier) of the tiny model in
    src_dir: its body, and a random `score` head over `num_labels` classes; `config`: fields
    set on its config.json (id2label, problem_type, use_pad_token, ...)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(str(src_dir), num_labels=num_labels)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForSequenceClassification.from_pretrained(str(src_dir), config=cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():  # logits of a few units: probabilities far from uniform
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(src_dir) / name).exists():
            shutil.copy(Path(src_dir) / name, Path(out_dir) / name)
    return Path(out_dir)


def with_tokenizer_code(model_dir: Path) -> Path:
    """The directory's tokenizer made one that ships its own Python code (transformers' auto_map), as
    some checkpoints' are: loading it needs trust_remote_code. The class is the fast tokenizer again."""
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]}, tokenizer_class="CustomTokenizer")
    cfg_path.write_text(json.dumps(cfg))
    (Path(model_dir) / "custom_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    ships_code = True\n")
    return Path(model_dir)


def gguf_roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w quantized and dequantized by gguf-py, as transformers loads a GGUF tensor."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(gguf.dequantize(gguf.quantize(w.detach().numpy(), t), t).reshape(w.shape).copy())


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """HF transformers generate, greedy, one prompt at a time (no padding), new tokens only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def tie_breaks(model_dir: str | Path, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]],
               device: str = "cpu", dtype: torch.dtype = torch.float32, max_gap: float = 0.02) -> list[str]:
    """Why `got` is not HF's greedy `expected` beyond ties the dtype cannot resolve: one line per
    sequence that differs other than at a near-tie (empty: they agree). Two bfloat16
    implementations (HF's kernels, the engine's) round differently, so where HF's two best logits
    lie within `max_gap` of the best's magnitude either may come first; from there the sequences
    go apart, and only the prefix before it is compared. vLLM's bfloat16 tests accept the same
    (its check_logprobs_close). The step is recomputed by one HF forward over the whole prefix:
    where that forward's best is the engine's token, HF's generate (its KV cache rounding
    otherwise) is the one that left it, and the engine is right."""
    from transformers import AutoModelForCausalLM

    model = None
    problems = []
    for i, (prompt, g, e) in enumerate(zip(prompts, got, expected)):
        k = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None)
        if k is None:
            if len(g) != len(e):
                problems.append(f"sequence {i}: {len(g)} tokens, HF {len(e)}")
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype).to(device).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + e[:k]], device=device)).logits[0, -1].float()
        two = logits.topk(2)
        (top, second), (best, runner_up) = two.values.tolist(), two.indices.tolist()
        gap = (top - second) / max(abs(top), 1e-6)
        if g[k] == best:
            continue
        if g[k] != runner_up:
            problems.append(f"sequence {i}, token {k}: {g[k]}, not one of HF's two best ({best}, {runner_up})")
        elif gap > max_gap:
            problems.append(f"sequence {i}, token {k}: {g[k]} where HF has {best}, {gap:.1e} apart (relative to the "
                            f"best), more than {max_gap}")
    return problems
