"""Random LoRA adapters for the tiny Llamas (tests/tiny_llama.py), written by PEFT itself, and
PEFT's greedy output as the oracle."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str | Path, out_dir: str | Path, targets: list[str] = ALL_TARGETS, r: int = 8,
                 alpha: int = 16, seed: int = 0, **config) -> str:
    """A PEFT LoRA adapter for the checkpoint in `base_dir`, its A and B both random (PEFT starts B
    at zero, which would change nothing), saved as `save_pretrained` saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """HF generate, greedy, one prompt at a time, through PEFT's model with the adapter (the base
    model alone for None); new tokens only."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    model.generation_config.eos_token_id = None  # the full length, like ignore_eos
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs
