"""A model directory with a known architecture and random weights, for GPU hosts the real weights
cannot reach: config.json, model.safetensors and a tokenizer.

The tokenizer is copied from --tokenizer when given (e.g. the embedded SmolLM2's, carried to the
host), else synthesized: a word-level vocabulary of one token per id ("<t123>"), so that token-id
prompts and detokenization work without any file from a hub.

    python benchmarks/random_model.py OUT_DIR [--shape smollm2-135m] [--dtype bfloat16] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SHAPES = {
    # SmolLM2-135M(-Instruct): 30 layers, hidden 576, 9 heads / 3 KV heads of 64, tied embeddings
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
    # Qwen3-0.6B, nano-vllm's and mini-sglang's model for this workload: 28 layers, hidden 1024,
    # 16 heads / 8 KV heads of 128, per-head q/k norms, tied embeddings (its tokenizer is synthesized)
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    # BERT-base, the shape of bge-base-en-v1.5, e5-base-v2 and most encoder embedding models: 12 layers,
    # hidden 768, 12 heads, 512 positions (an encoder: saved as a bare BertModel, it pools CLS)
    "bert-base": dict(model_type="bert", vocab_size=30522, hidden_size=768, intermediate_size=3072,
                      num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2,
                      pad_token_id=0, encoder=True),
    # ModernBERT-base, the shape of gte-modernbert-base and modernbert-embed-base: 22 layers, hidden
    # 768, 12 heads, a gated MLP of 1152, every third layer global and the rest within 64 tokens each way
    "modernbert-base": dict(model_type="modernbert", vocab_size=50368, hidden_size=768, intermediate_size=1152,
                            num_hidden_layers=22, num_attention_heads=12, max_position_embeddings=8192,
                            local_attention=128, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, cls_token_id=1, sep_token_id=2, encoder=True),
    # GTE-base, gte-base-en-v1.5's shape: 12 layers, hidden 768, 12 heads, a GeGLU MLP of 3,072, no
    # token types, rotary positions with the hub's NTK scaling by 2 at theta 500,000 (as transformers'
    # GteConfig writes it: linear by 2^(2/64) at theta 1,000,000)
    "gte-base": dict(model_type="gte", vocab_size=30528, hidden_size=768, intermediate_size=3072,
                     num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=8192, type_vocab_size=0,
                     rope_parameters={"rope_type": "linear", "factor": 2 ** (2 / 64), "rope_theta": 1e6},
                     pad_token_id=0, encoder=True),
    # DistilBERT-base, msmarco-distilbert's and the sst-2 classifier's: 6 layers, hidden 768, 12 heads
    "distilbert-base": dict(model_type="distilbert", vocab_size=30522, hidden_size=768, hidden_dim=3072,
                            n_layers=6, num_attention_heads=12, max_position_embeddings=512, pad_token_id=0,
                            encoder=True),
    # SmolLM2's vocabulary around a forward that costs next to nothing: the engine's own host work
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2, pad_token_id=2),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_random_model(out_dir: Path, shape: str = "smollm2-135m", dtype: str = "bfloat16",
                      tokenizer_dir: str | None = None, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir  # made before (same arguments assumed)
    torch.manual_seed(seed)
    params = dict(SHAPES[shape])
    encoder = params.pop("encoder", False)
    config = AutoConfig.for_model(params.pop("model_type", "llama"), **params)
    auto = AutoModel if encoder else AutoModelForCausalLM
    model = auto.from_config(config).to(getattr(torch, dtype)).eval()  # HF's init: normal(0, 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir and not _vocab_fits(tokenizer_dir, config.vocab_size):
        print(f"{tokenizer_dir}'s tokenizer does not cover {config.vocab_size} ids: synthesizing one")
        tokenizer_dir = None
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    else:
        synthetic_tokenizer(config.vocab_size).save_pretrained(out_dir)
    return out_dir


def make_random_adapter(out_dir: Path, model_dir: Path, rank: int, seed: int = 0) -> Path:
    """A random LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) for
    the checkpoint in `model_dir`, adapting all seven projections of every layer (made once)."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if (out_dir / "adapter_model.safetensors").exists():
        return out_dir
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}  # (in, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n.split(".")[1] for n in shapes]}))
    return out_dir


def cached_random_adapter(model_dir: Path, rank: int, seed: int = 0) -> Path:
    """make_random_adapter's adapter for `model_dir`, made once in $KVSERVE_CACHE/random-adapters."""
    from engine.model_source import cache_dir

    out = cache_dir() / "random-adapters" / f"{Path(model_dir).name}-r{rank}-{seed}"
    return make_random_adapter(out, Path(model_dir), rank, seed)


def _vocab_fits(tokenizer_dir: str, vocab_size: int) -> bool:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir)) >= vocab_size


def synthetic_tokenizer(vocab_size: int):
    """One word-level token per id; ids 0, 1, 2 are unk, bos, eos as in SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>",
                                   pad_token="<t2>")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokenizer", default=None, help="copy this directory's tokenizer (default: synthesize one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_random_model(Path(args.out_dir), args.shape, args.dtype, args.tokenizer, args.seed))


if __name__ == "__main__":
    main()
