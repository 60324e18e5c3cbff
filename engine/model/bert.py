"""Encoder models: BERT, RoBERTa and XLM-RoBERTa, whose attention runs over the whole input both
ways. They embed (sentence-transformers' all-MiniLM, bge, e5, ...; vLLM's BertModel and
XLMRobertaModel) and score pairs as cross-encoders (ms-marco-MiniLM, bge-reranker;
`...ForSequenceClassification`).

An encoder keeps no KV cache. Each prompt runs whole in one step (the engine turns chunked
prefill and prefix caching off for it: a token's state depends on the tokens after it). The
linear layers take the step's tokens flat, unpadded; attention runs per prompt over its own
tokens. The step's output is one row per prompt (EncoderRunner), pooled here as the model's
pooler says:

    CLS   the first token's final state (BERT's [CLS], RoBERTa's <s>); vLLM's default for these
    MEAN  the mean over the prompt's tokens (all-MiniLM's sentence-transformers pooling)
    LAST  the last token's

A classifier's head reads the first token's state, as HF's does: BERT's pooler (dense, tanh)
then `classifier`; RoBERTa's `classifier.dense`, tanh, `classifier.out_proj`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# checkpoint tensors no encoder here reads: masked-LM heads, a position-id buffer
_SKIPPED = ("cls.", "lm_head.", "embeddings.position_ids")


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act: str, dtype: torch.dtype) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden, dtype=dtype) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up = nn.Linear(hidden, intermediate, dtype=dtype)
        self.act = ACT2FN[act]
        self.down = nn.Linear(intermediate, hidden, dtype=dtype)
        self.out_norm = nn.LayerNorm(hidden, eps, dtype=dtype)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """x: (T, hidden), the prompts one after another, lens[i] tokens each. The linear layers
        take the rows flat; attention runs per prompt, over its own rows only (no mask, no padding)."""
        t, hidden = x.shape
        q, k, v = (p(x).view(t, self.heads, hidden // self.heads).transpose(0, 1)
                   for p in (self.query, self.key, self.value))  # (heads, T, head_dim)
        a = torch.cat([F.scaled_dot_product_attention(*qkv) for qkv in zip(q.split(lens, 1), k.split(lens, 1),
                                                                         v.split(lens, 1))], dim=1)
        x = self.attn_norm(self.attn_out(a.transpose(0, 1).reshape(t, hidden)) + x)
        return self.out_norm(self.down(self.act(self.up(x))) + x)


class EncoderModel(nn.Module):
    """The encoder and, for a classifier (`arch.num_labels`), its head. `forward` takes the step's
    prompts flat and gives one pooled row each: a vector, or the head's logits."""

    def __init__(self, a, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = a
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(a.position_rows, a.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size, dtype=dtype)
        self.embed_norm = nn.LayerNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(a.hidden_size, a.num_heads, a.intermediate_size, a.rms_norm_eps,
                                                 a.hidden_act, dtype) for _ in range(a.num_layers))
        self.head_dense = self.head_out = None
        if a.num_labels:
            self.head_dense = nn.Linear(a.hidden_size, a.hidden_size, dtype=dtype)
            self.head_out = nn.Linear(a.hidden_size, a.num_labels, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, lens: list[int], token_types: torch.Tensor,
                pooling_type: str) -> torch.Tensor:
        """input_ids, token_types: (T,) the prompts one after another, lens[i] tokens each ->
        (len(lens), hidden or num_labels) float32."""
        device = input_ids.device
        lens_t = torch.tensor(lens, device=device)
        ends = lens_t.cumsum(0)
        starts = ends - lens_t
        positions = torch.arange(input_ids.shape[0], device=device) - starts.repeat_interleave(lens_t)
        x = self.embed_norm(self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
                            + self.position_embeddings(positions + self.arch.position_offset))
        for layer in self.layers:
            x = layer(x, lens)
        if self.head_out is not None:  # the head reads the first token's state, whatever the pooler
            return self.head_out(torch.tanh(self.head_dense(x[starts]))).float()
        if pooling_type == "CLS":
            return x[starts].float()
        if pooling_type == "LAST":
            return x[ends - 1].float()
        return torch.stack([rows.mean(dim=0) for rows in x.split(lens)]).float()  # MEAN

    # checkpoint name (after the model prefix) -> ours, for the names that differ
    RENAMES = (("embeddings.word_embeddings.", "word_embeddings."),
               ("embeddings.position_embeddings.", "position_embeddings."),
               ("embeddings.token_type_embeddings.", "token_type_embeddings."),
               ("embeddings.LayerNorm.", "embed_norm."), ("encoder.layer.", "layers."),
               (".attention.self.", "."), (".attention.output.dense.", ".attn_out."),
               (".attention.output.LayerNorm.", ".attn_norm."), (".intermediate.dense.", ".up."),
               (".output.dense.", ".down."), (".output.LayerNorm.", ".out_norm."),
               # the heads: BERT's pooler + classifier, RoBERTa's classifier.dense + out_proj
               ("pooler.dense.", "head_dense."), ("classifier.dense.", "head_dense."),
               ("classifier.out_proj.", "head_out."), ("classifier.", "head_out."))

    def param_for(self, ckpt_name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, None] | None:
        """A checkpoint tensor's parameter (None: a tensor no encoder here reads). Names as HF
        saves them, with or without the model prefix, and old checkpoints' gamma/beta."""
        name = ckpt_name
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith(_SKIPPED) or (name.startswith("pooler.") and not (self.head_out is not None
                                                                             and self.arch.bert_pooler)):
            return None  # a pooler no head reads (RoBERTa's classifiers have their own dense; HF skips it too)
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        for src, dst in self.RENAMES:  # ".x." anywhere in the name, "x." at its start
            if (src in name) if src.startswith(".") else name.startswith(src):
                name = name.replace(src, dst, 1)
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {ckpt_name!r}")
        return params[name], None
