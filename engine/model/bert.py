"""Encoder models of BERT's layout: BERT, RoBERTa, XLM-RoBERTa, DistilBERT, NomicBERT and GTE, whose
attention runs over the whole input both ways. They embed (sentence-transformers' all-MiniLM, bge, e5,
nomic-embed-text, gte-base-en-v1.5, gte-multilingual-base; vLLM's BertModel, XLMRobertaModel,
NomicBertModel, GteNewModel) and score pairs as cross-encoders (ms-marco-MiniLM, bge-reranker,
gte-multilingual-reranker-base; `...ForSequenceClassification`).

Each layer is post-norm: attention, residual, LayerNorm; MLP, residual, LayerNorm. BERT's
positions are a learned table; NomicBERT's and GTE's are rotary (`arch.rotary`), and their MLP
is gated (down(act(gate(x)) * up(x)): NomicBERT's SwiGLU without biases, GTE's GeGLU with a bias on
`down` only). The up and gate projections run as one (`up_gate`), as q, k and v do (`qkv`).

An encoder keeps no KV cache. Each prompt runs whole in one step (the engine turns chunked
prefill and prefix caching off for it: a token's state depends on the tokens after it). The
linear layers take the step's tokens flat, unpadded; attention runs per prompt over its own
tokens. The step's output is one row per prompt (EncoderRunner), pooled here as the model's
pooler says:

    CLS   the first token's final state (BERT's [CLS], RoBERTa's <s>); vLLM's default for these
    MEAN  the mean over the prompt's tokens (all-MiniLM's sentence-transformers pooling)
    LAST  the last token's

A classifier's head reads the first token's state, as HF's does: BERT's pooler (dense, tanh)
then `classifier`; RoBERTa's `classifier.dense`, tanh, `classifier.out_proj`; DistilBERT's
`pre_classifier`, ReLU, `classifier`. A token
classifier's (`...ForTokenClassification`) is its `classifier` over every token's state.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.rope import prompt_rope, rope_inv_freq, rotate_heads

# checkpoint tensors no encoder here reads: masked-LM heads, a position-id buffer
_SKIPPED = ("cls.", "lm_head.", "vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "embeddings.position_ids")
_QKV = ("query", "key", "value")
_UP_GATE = ("up", "gate")  # the halves of a gated MLP's fused projection, in GTE's order


def prompt_layout(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's prompts, one after another, lens[i] tokens each -> each one's first row, its row
    past the last, and every row's position within its prompt."""
    lens_t = torch.tensor(lens, device=device)
    ends = lens_t.cumsum(0)
    starts = ends - lens_t
    positions = torch.arange(int(sum(lens)), device=device) - starts.repeat_interleave(lens_t)
    return starts, ends, positions


def pooled_rows(x: torch.Tensor, lens: list[int], starts: torch.Tensor, ends: torch.Tensor,
                pooling_type: str) -> torch.Tensor:
    """One row per prompt of x (T, hidden), as `pooling_type` pools it (CLS, LAST or MEAN)."""
    if pooling_type == "CLS":
        return x[starts]
    if pooling_type == "LAST":
        return x[ends - 1]
    return torch.stack([rows.mean(dim=0) for rows in x.split(lens)])


def pooled_outputs(x: torch.Tensor, lens: list[int], starts: torch.Tensor, ends: torch.Tensor, pooling_type: str,
                   every_token: list[bool] | None) -> torch.Tensor | list[torch.Tensor]:
    """An embedding model's output: one pooled row per prompt (pooled_rows), float32; where
    `every_token` marks a prompt (a token_embed request), a list of per-prompt tensors in which
    that prompt's is its every row (tokens, hidden)."""
    pooled = pooled_rows(x, lens, starts, ends, pooling_type).float()
    if not every_token or not any(every_token):
        return pooled
    return [rows.float() if every else row for rows, row, every in zip(x.split(lens), pooled, every_token)]


def per_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                         masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """q, k, v: (heads, T, head_dim), the prompts' rows one after another -> (T, heads * head_dim):
    each prompt's attention over its own rows only, both ways (with its mask, where one is given;
    prompts of one length have one). Consecutive prompts of one length run as one batch, a view
    of their rows (EncoderRunner orders a step's prompts by length): one call for them all."""
    masks = masks or [None] * len(lens)
    heads, _, d = q.shape
    parts, row, first = [], 0, 0
    for n, run in itertools.groupby(lens):
        count = len(list(run))
        end = row + n * count
        qb, kb, vb = (x[:, row:end].view(heads, count, n, d).transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=masks[first])  # (count, heads, n, d)
        parts.append(o.transpose(1, 2).reshape(count * n, heads * d))
        row, first = end, first + count
    return torch.cat(parts)


def _fused(linear: nn.Linear, parts: tuple[str, ...]) -> nn.Linear:
    """A projection fused from equal `parts` along its outputs: each parameter loads whole (a
    checkpoint's packed tensor: NomicBERT's Wqkv, GTE's qkv_proj and up_gate_proj) or by part
    (BERT's query, key and value; NomicBERT's fc11 and fc12)."""
    def load(param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        (param.data if shard is None else param.data.chunk(len(parts), dim=0)[parts.index(shard)]).copy_(tensor)

    for p in linear.parameters():
        p.weight_loader, p.shard_ids = load, parts
        p.full_shape = lambda shard, p=p: p.shape if shard is None else (p.shape[0] // len(parts), *p.shape[1:])
    return linear


class EncoderLayer(nn.Module):
    def __init__(self, a, dtype: torch.dtype) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        h, inter = a.hidden_size, a.intermediate_size
        self.heads = a.num_heads
        self.qkv = _fused(nn.Linear(h, 3 * h, bias=a.attention_bias, dtype=dtype), _QKV)
        self.attn_out = nn.Linear(h, h, bias=a.attention_bias, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, a.rms_norm_eps, bias=a.norm_bias, dtype=dtype)
        up_bias = a.mlp_bias if a.up_bias is None else a.up_bias
        self.up = None if a.gated_mlp else nn.Linear(h, inter, bias=up_bias, dtype=dtype)
        self.up_gate = _fused(nn.Linear(h, 2 * inter, bias=up_bias, dtype=dtype), _UP_GATE) if a.gated_mlp else None
        self.act = ACT2FN[a.hidden_act]
        self.down = nn.Linear(inter, h, bias=a.mlp_bias, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, a.rms_norm_eps, bias=a.norm_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, lens: list[int], rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x: (T, hidden), the prompts one after another, lens[i] tokens each; `rope`: the rows'
        cos and sin (rotary positions), or None."""
        t, hidden = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, hidden // self.heads).permute(1, 2, 0, 3)  # 3 x (heads, T, hd)
        if rope is not None:
            q, k = rotate_heads(q, *rope), rotate_heads(k, *rope)
        x = self.attn_norm(self.attn_out(per_prompt_attention(q, k, v, lens)) + x)
        if self.up_gate is None:
            y = self.act(self.up(x))
        else:
            up, gate = self.up_gate(x).chunk(2, dim=-1)
            y = self.act(gate) * up
        return self.out_norm(self.down(y) + x)


class EncoderModel(nn.Module):
    """The encoder and, for a classifier (`arch.num_labels`), its head. `forward` takes the step's
    prompts flat and gives one pooled row each: a vector, or the head's logits."""

    def __init__(self, a, dtype: torch.dtype) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.arch = a
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.position_embeddings = None if a.rotary else nn.Embedding(a.position_rows, a.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size, dtype=dtype) \
            if a.type_vocab_size else None  # DistilBERT and gte-base-en-v1.5 have no token types
        self.embed_norm = nn.LayerNorm(a.hidden_size, a.rms_norm_eps, bias=a.norm_bias, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(a, dtype) for _ in range(a.num_layers))
        self.head_dense = self.head_out = None
        if a.num_labels:
            if not a.token_classifier:
                self.head_dense = nn.Linear(a.hidden_size, a.hidden_size, dtype=dtype)
            self.head_out = nn.Linear(a.hidden_size, a.num_labels, dtype=dtype)
        self.head_act = ACT2FN[a.classifier_act]
        if a.rotary:  # float32, as HF keeps them
            self.register_buffer("inv_freq", rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), persistent=False)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, lens: list[int], token_types: torch.Tensor,
                pooling_type: str, every_token: list[bool] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """input_ids, token_types: (T,) the prompts one after another, lens[i] tokens each ->
        (len(lens), hidden or num_labels) float32; a token classifier's: each prompt's
        (lens[i], num_labels); an embedding model's with prompts `every_token` marks: pooled_outputs'."""
        starts, ends, positions = prompt_layout(lens, input_ids.device)
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_types)
        rope = None
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions + self.arch.position_offset)
        else:
            rope = prompt_rope(self.inv_freq, positions, x.dtype)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, lens, rope)
        if self.arch.token_classifier:
            return list(self.head_out(x).float().split(lens))
        if self.head_out is not None:  # the head reads the first token's state, whatever the pooler
            return self.head_out(self.head_act(self.head_dense(x[starts]))).float()
        return pooled_outputs(x, lens, starts, ends, pooling_type, every_token)

    # checkpoint name (after the model prefix) -> ours, for the names that differ: BERT's and
    # RoBERTa's; DistilBERT's; NomicBERT's (nomic-embed-text's, which transformers' NomicBert saves
    # too); GTE's (the hub's, which transformers' Gte saves too)
    RENAMES = (("embeddings.word_embeddings.", "word_embeddings."),
               ("embeddings.position_embeddings.", "position_embeddings."),
               ("embeddings.token_type_embeddings.", "token_type_embeddings."),
               ("embeddings.LayerNorm.", "embed_norm."), ("emb_ln.", "embed_norm."),
               ("encoder.layer.", "layers."), ("encoder.layers.", "layers."),
               (".attention.self.", "."), (".attention.output.dense.", ".attn_out."),
               (".attention.output.LayerNorm.", ".attn_norm."), (".intermediate.dense.", ".up."),
               (".output.dense.", ".down."), (".output.LayerNorm.", ".out_norm."),
               (".attn.Wqkv.", ".qkv."), (".attn.out_proj.", ".attn_out."), (".mlp.fc11.", ".up."),
               (".mlp.fc12.", ".gate."), (".mlp.fc2.", ".down."), (".norm1.", ".attn_norm."), (".norm2.", ".out_norm."),
               (".attention.qkv_proj.", ".qkv."), (".attention.o_proj.", ".attn_out."), (".attn_ln.", ".attn_norm."),
               (".mlp.up_gate_proj.", ".up_gate."), (".mlp.down_proj.", ".down."), (".mlp_ln.", ".out_norm."),
               ("transformer.layer.", "layers."), (".attention.q_lin.", ".query."), (".attention.k_lin.", ".key."),
               (".attention.v_lin.", ".value."), (".attention.out_lin.", ".attn_out."),
               (".sa_layer_norm.", ".attn_norm."),
               (".ffn.lin1.", ".up."), (".ffn.lin2.", ".down."), (".output_layer_norm.", ".out_norm."),
               # the heads: BERT's pooler + classifier, RoBERTa's classifier.dense + out_proj,
               # DistilBERT's pre_classifier + classifier
               ("pooler.dense.", "head_dense."), ("classifier.dense.", "head_dense."),
               ("pre_classifier.", "head_dense."),
               ("classifier.out_proj.", "head_out."), ("classifier.", "head_out."))

    def param_for(self, ckpt_name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, str | None] | None:
        """A checkpoint tensor's parameter and, for query, key or value, its third of the fused projection
        (None: a tensor no encoder here reads). Names as HF saves them, with or without the
        model prefix, and old checkpoints' gamma/beta."""
        name = ckpt_name
        for prefix in ("bert.", "roberta.", "distilbert.", "nomic_bert.", "new.", "gte.", "model."):
            name = name.removeprefix(prefix)
        unread_pooler = name.startswith("pooler.") and not (self.head_dense is not None and self.arch.bert_pooler)
        unread_head = name.startswith("classifier.") and self.head_out is None
        if name.startswith(_SKIPPED) or name.endswith(".inv_freq") or unread_pooler or unread_head:
            # a pooler no head reads (RoBERTa's classifiers have their own dense; HF skips it too);
            # an embedding model's head (gte-multilingual-base's sparse-weight one); an old
            # checkpoint's rotary buffer
            return None
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        for src, dst in self.RENAMES:  # ".x." anywhere in the name, "x." at its start
            if (src in name) if src.startswith(".") else name.startswith(src):
                name = name.replace(src, dst, 1)
        layer, _, rest = name.rpartition(".")  # "layers.0.query.weight": ("layers.0.query", "weight")
        head, _, proj = layer.rpartition(".")
        gated = proj in _UP_GATE and f"{head}.up_gate.{rest}" in params  # a gated MLP's up or gate
        fused = "qkv" if proj in _QKV else "up_gate" if gated else None
        shard = proj if head.startswith("layers.") and fused else None
        if shard is not None:
            name = f"{head}.{fused}.{rest}"
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {ckpt_name!r}")
        return params[name], shard
