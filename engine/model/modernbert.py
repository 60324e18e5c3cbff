"""ModernBERT (answerdotai's; gte-modernbert, modernbert-embed, gte-reranker-modernbert): an
encoder like engine.model.bert's, run the same way (each prompt whole, linear layers over the
step's tokens flat, attention per prompt), with a newer layer:

    pre-norm layers (LayerNorms, biases only where the config sets them), the first layer's
    attention reading the embeddings' norm directly
    rotary positions instead of a position table, with a theta for global layers and one for
    local ones
    local layers (all but every `global_attn_every_n_layers`-th) attend within a window both ways:
    token i reads j where |i - j| <= local_attention // 2, as HF's mask has it
    a gated MLP: Wi gives (input, gate), Wo reads act(input) * gate
    a final LayerNorm; no token types

A classifier pools as its config's `classifier_pooling` says (the first token, or the mean),
then its head: dense, activation, LayerNorm, then `classifier`. Module names are HF's but for the
embeddings' two (param_for), so a checkpoint's names map onto them once the `model.` prefix is off."""
from __future__ import annotations

import torch
from torch import nn

from engine.model.bert import per_prompt_attention, pooled_outputs, pooled_rows, prompt_layout
from engine.model.rope import prompt_rope, rope_inv_freq, rotate_heads


def _norm(a, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(a.hidden_size, a.rms_norm_eps, bias=a.norm_bias, dtype=dtype)


class Attention(nn.Module):
    def __init__(self, a, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = a.num_heads
        self.Wqkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=a.attention_bias, dtype=dtype)
        self.Wo = nn.Linear(a.hidden_size, a.hidden_size, bias=a.attention_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, lens: list[int], rope: tuple[torch.Tensor, torch.Tensor],
                masks: list[torch.Tensor | None]) -> torch.Tensor:
        t, hidden = x.shape
        q, k, v = self.Wqkv(x).view(t, 3, self.heads, hidden // self.heads).permute(1, 2, 0, 3)  # 3 x (heads, T, hd)
        q, k = rotate_heads(q, *rope, upcast=True), rotate_heads(k, *rope, upcast=True)  # in float32, as HF's
        return self.Wo(per_prompt_attention(q, k, v, lens, masks))


class MLP(nn.Module):
    def __init__(self, a, dtype: torch.dtype) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.Wi = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias, dtype=dtype)
        self.act = ACT2FN[a.hidden_act]
        self.Wo = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


class Layer(nn.Module):
    def __init__(self, a, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.local = index in a.sliding_layers
        self.attn_norm = nn.Identity() if index == 0 else _norm(a, dtype)
        self.attn = Attention(a, dtype)
        self.mlp_norm = _norm(a, dtype)
        self.mlp = MLP(a, dtype)

    def forward(self, x: torch.Tensor, lens: list[int], ropes: dict, masks: list[torch.Tensor | None]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), lens, ropes[self.local], masks if self.local else None)
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    def __init__(self, a, dtype: torch.dtype) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size, bias=a.classifier_bias, dtype=dtype)
        self.act = ACT2FN[a.classifier_act]
        self.norm = _norm(a, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertEncoder(nn.Module):
    """engine.model.bert.EncoderModel's interface: `forward` takes the step's prompts flat and
    gives one pooled row each, a vector or the head's logits."""

    def __init__(self, a, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.embed_norm = _norm(a, dtype)
        self.layers = nn.ModuleList(Layer(a, i, dtype) for i in range(a.num_layers))
        self.final_norm = _norm(a, dtype)
        self.head = self.classifier = None
        if a.num_labels:
            self.head = Head(a, dtype)
            self.classifier = nn.Linear(a.hidden_size, a.num_labels, dtype=dtype)
        # (inverse frequencies) for global and local layers, float32 as HF keeps them
        self.register_buffer("global_freq", rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), persistent=False)
        self.register_buffer("local_freq", rope_inv_freq(a.head_dim, a.local_rope_theta, a.rope_scaling),
                             persistent=False)
        self.requires_grad_(False)

    def _window_masks(self, lens: list[int], device: torch.device) -> list[torch.Tensor | None]:
        """Each prompt's local-attention mask (True: may attend); None where the window spans it whole."""
        half, masks, made = self.arch.local_window, [], {}
        for n in lens:
            if n - 1 <= half:
                masks.append(None)
                continue
            if n not in made:
                i = torch.arange(n, device=device)
                made[n] = (i[:, None] - i[None, :]).abs() <= half
            masks.append(made[n])
        return masks

    def forward(self, input_ids: torch.Tensor, lens: list[int], token_types: torch.Tensor,
                pooling_type: str, every_token: list[bool] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """input_ids: (T,) the prompts one after another, lens[i] tokens each (`token_types`:
        unread, ModernBERT has none) -> (len(lens), hidden or num_labels) float32; a token
        classifier's: each prompt's (lens[i], num_labels); an embedding model's with prompts
        `every_token` marks: engine.model.bert.pooled_outputs'."""
        starts, ends, positions = prompt_layout(lens, input_ids.device)
        x = self.embed_norm(self.tok_embeddings(input_ids))
        ropes = {False: prompt_rope(self.global_freq, positions, x.dtype),
                 True: prompt_rope(self.local_freq, positions, x.dtype)}
        masks = self._window_masks(lens, input_ids.device)
        for layer in self.layers:
            x = layer(x, lens, ropes, masks)
        x = self.final_norm(x)
        if self.arch.token_classifier:  # the head over every token
            return list(self.classifier(self.head(x)).float().split(lens))
        if self.head is not None:  # the head reads the state its config's classifier_pooling gives
            return self.classifier(self.head(pooled_rows(x, lens, starts, ends, self.arch.classifier_pooling))).float()
        return pooled_outputs(x, lens, starts, ends, pooling_type, every_token)

    def param_for(self, ckpt_name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, None] | None:
        """A checkpoint tensor's parameter (None: one no model here reads: a masked-LM head)."""
        name = ckpt_name.removeprefix("model.")
        if name.startswith("decoder.") or (name.startswith("head.") and self.head is None):
            return None
        name = name.replace("embeddings.tok_embeddings.", "tok_embeddings.").replace("embeddings.norm.", "embed_norm.")
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {ckpt_name!r}")
        return params[name], None

