"""The ModelArch fields of an encoder's config (engine.model.bert's BERT, RoBERTa, XLM-RoBERTa,
DistilBERT, NomicBERT and GTE; engine.model.modernbert's ModernBERT), as transformers reads the
config.json; GTE's hub config, which transformers cannot read, as its GteConfig (hub_gte_config)."""
from __future__ import annotations

from engine.classifier import has_classifier_head, is_token_classifier


def encoder_fields(cfg) -> dict:
    """ModelArch's fields for an encoder's config; ValueError for what the engine does not run."""
    if cfg.model_type == "modernbert":
        return _modernbert(cfg)
    if cfg.model_type == "nomic_bert":
        return _nomic(cfg)
    if cfg.model_type == "gte":
        return _gte(cfg)
    if cfg.model_type == "distilbert":
        return _distilbert(cfg)
    return _encoder(cfg)


def _encoder(cfg) -> dict:
    """A BERT / RoBERTa / XLM-RoBERTa config: the fields sizing and the engine read, LayerNorm's
    eps as the norm's. RoBERTa's positions start past its padding index (HF's
    create_position_ids_from_input_ids): its usable positions are that many fewer."""
    from transformers.activations import ACT2FN

    kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"unsupported position_embedding_type {kind!r} (encoders: only absolute)")
    if cfg.hidden_act not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise ValueError(f"this {cfg.model_type} config is a decoder (is_decoder): kvserve runs BERT-style "
                         "models as encoders only")
    pad = getattr(cfg, "pad_token_id", None)
    offset = 0 if cfg.model_type == "bert" else (1 if pad is None else pad) + 1
    heads = cfg.num_attention_heads
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
                head_dim=cfg.hidden_size // heads, rms_norm_eps=cfg.layer_norm_eps, rope_theta=0.0,
                rope_scaling=None, max_position_embeddings=cfg.max_position_embeddings - offset,
                tie_word_embeddings=False, attention_bias=True, mlp_bias=True, o_proj_bias=True,
                num_labels=_encoder_labels(cfg), token_classifier=is_token_classifier(cfg), encoder=True,
                type_vocab_size=cfg.type_vocab_size, position_offset=offset,
                position_rows=cfg.max_position_embeddings, hidden_act=cfg.hidden_act,
                bert_pooler=cfg.model_type == "bert", classifier_act="tanh")


def _distilbert(cfg) -> dict:
    """A DistilBERT config (its own names: dim, hidden_dim, n_layers, n_heads, activation): BERT's
    layers without token types, LayerNorm eps 1e-12 as HF fixes it; a classifier's head is
    pre_classifier, ReLU, classifier over [CLS]."""
    from transformers.activations import ACT2FN

    if cfg.activation not in ACT2FN:
        raise ValueError(f"unsupported activation {cfg.activation!r}")
    heads = cfg.n_heads
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                num_layers=cfg.n_layers, num_heads=heads, num_kv_heads=heads, head_dim=cfg.dim // heads,
                rms_norm_eps=1e-12, rope_theta=0.0, rope_scaling=None,
                max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=False, attention_bias=True, mlp_bias=True, o_proj_bias=True,
                num_labels=_encoder_labels(cfg), token_classifier=is_token_classifier(cfg), encoder=True,
                type_vocab_size=0, position_rows=cfg.max_position_embeddings, hidden_act=cfg.activation,
                classifier_act="relu")

def _nomic(cfg) -> dict:
    """A NomicBERT config: nomic's own (its hub checkpoints', nomic-embed-text v1 and v1.5: GPT-2
    names, n_embd, n_layer, rotary_emb_base, ...) or transformers' NomicBertConfig. Usable
    positions: nomic's max_trained_positions (2,048), past which its rotary scaling would
    start; up to there the model is exact."""
    from transformers.activations import ACT2FN

    if hasattr(cfg, "n_embd"):  # nomic's own config, read by transformers' class: its names are extra fields
        unsupported = [f"{k}={getattr(cfg, k)!r}" for k, ok in (
            ("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False), ("prenorm", False),
            ("use_rms_norm", False), ("parallel_block", False), ("num_experts", 0),
            ("activation_function", "swiglu")) if getattr(cfg, k, ok) not in (ok, None)]
        biases = {getattr(cfg, k, False) for k in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias")}
        if len(biases) > 1:
            unsupported.append("qkv_proj_bias, mlp_fc1_bias and mlp_fc2_bias not all equal")
        if unsupported:
            raise ValueError(f"this NomicBERT config is not supported: {', '.join(unsupported)} (kvserve runs "
                             "nomic-embed-text's layout: full rotary, halves layout, post-norm, SwiGLU)")
        hidden, layers, heads = cfg.n_embd, cfg.n_layer, cfg.n_head
        inter = getattr(cfg, "n_inner", None) or 4 * hidden
        eps, act, bias = cfg.layer_norm_epsilon, "silu", biases.pop()
        theta = float(getattr(cfg, "rotary_emb_base", 10000))
        positions = getattr(cfg, "max_trained_positions", None) or getattr(cfg, "n_positions", 2048)
        scaling = None
    else:
        if cfg.hidden_act not in ACT2FN:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        hidden, layers, heads, inter = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                        cfg.intermediate_size)
        eps, act, bias, positions = cfg.layer_norm_eps, cfg.hidden_act, False, cfg.max_position_embeddings
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", None) or 1000.0)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
    return dict(vocab_size=cfg.vocab_size, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rms_norm_eps=eps, rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=positions, tie_word_embeddings=False,
                attention_bias=bool(bias), mlp_bias=bool(bias), o_proj_bias=bool(bias),
                num_labels=_encoder_labels(cfg), token_classifier=is_token_classifier(cfg), encoder=True,
                type_vocab_size=cfg.type_vocab_size, hidden_act=act, bert_pooler=True, rotary=True, gated_mlp=True,
                classifier_act="tanh")

def _gte(cfg) -> dict:
    """A GTE config (transformers' GteConfig, or the hub's read into one): BERT's post-norm layers
    with rotary positions and a gated MLP (GeGLU) whose up and gate projections have no bias;
    token types only where type_vocab_size is above 0 (gte-base-en-v1.5 has none)."""
    from transformers.activations import ACT2FN

    if cfg.hidden_act not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
    heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.pop("rope_theta", None) or cfg.default_theta)
    scaling = rope if rope.get("rope_type", "default") != "default" else None  # checked: ModelArch.rope_checked
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
                head_dim=cfg.hidden_size // heads, rms_norm_eps=cfg.layer_norm_eps, rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
                attention_bias=True, mlp_bias=True, up_bias=False, o_proj_bias=True,
                num_labels=_encoder_labels(cfg), token_classifier=is_token_classifier(cfg), encoder=True,
                type_vocab_size=cfg.type_vocab_size, hidden_act=cfg.hidden_act, bert_pooler=True, rotary=True,
                gated_mlp=True, classifier_act="tanh")


# What GTE's hub code implements, each field's value for it (other values are refused)
_GTE_HUB_LAYOUT = (("position_embedding_type", "rope"), ("layer_norm_type", "layer_norm"), ("pack_qkv", True),
                   ("logn_attention_scale", False), ("logn_attention_clip1", False))


def is_hub_gte(raw: dict) -> bool:
    """A GTE config in the hub's form: model_type "new" (Alibaba-NLP's gte-base-en-v1.5,
    gte-large-en-v1.5, gte-multilingual-base and gte-multilingual-reranker-base), or "gte" with
    the hub's rotary fields rather than transformers' rope_parameters (Snowflake's
    snowflake-arctic-embed-m-v2.0); only their remote code reads them."""
    return raw.get("model_type") == "new" or (raw.get("model_type") == "gte" and "rope_parameters" not in raw)


def hub_gte_config(raw: dict, path: str = "config.json"):
    """GTE's hub config (is_hub_gte) as transformers' GteConfig, whose fields are the same but for
    rotary's. The hub's fixed NTK scaling (theta times the factor, then every frequency over
    factor^(2/head_dim)) is exactly transformers' "linear" scaling by factor^(2/head_dim) at that
    theta."""
    from transformers import GteConfig

    unsupported = [f"{k}={raw[k]!r}" for k, ok in _GTE_HUB_LAYOUT if raw.get(k, ok) != ok]
    theta = float(raw.get("rope_theta", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = raw.get("rope_scaling")
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
        if kind != "ntk" or scaling.get("mixed_b") is not None or not scaling.get("factor"):
            unsupported.append(f"rope_scaling={scaling!r}")
        else:
            factor, head_dim = float(scaling["factor"]), raw["hidden_size"] // raw["num_attention_heads"]
            rope = {"rope_type": "linear", "factor": factor ** (2 / head_dim), "rope_theta": theta * factor}
    if unsupported:
        raise ValueError(f"{path!r}: this GTE config is not supported: {', '.join(unsupported)} (kvserve runs the "
                         "hub layout of gte-*-v1.5 and gte-multilingual: rotary positions, fixed NTK scaling, "
                         "packed q/k/v, post-norm LayerNorms)")
    skipped = {"model_type", "rope_theta", "rope_scaling", "auto_map", "transformers_version"}
    fields = {k: v for k, v in raw.items() if k not in skipped}
    if raw.get("architectures") == ["NewForTokenClassification"] and len(raw.get("id2label") or {}) <= 1:
        # gte-multilingual-base's: an embedding model whose one-label head gives sparse (lexical)
        # token weights, which embeddings do not read (vLLM serves it as GteNewModel too)
        fields = {k: v for k, v in fields.items() if k not in ("id2label", "label2id")}
        fields["architectures"] = ["NewModel"]
    return GteConfig(**fields, rope_parameters=rope)


def _modernbert(cfg) -> dict:
    """A ModernBERT config, as transformers 5 keeps it (layer_types, rope_parameters per layer
    type) or as older ones and the hub's configs have it (global_attn_every_n_layers,
    global_rope_theta, local_rope_theta)."""
    from transformers.activations import ACT2FN

    for act in (cfg.hidden_activation, getattr(cfg, "classifier_activation", "gelu")):
        if act not in ACT2FN:
            raise ValueError(f"unsupported activation {act!r}")
    every = getattr(cfg, "global_attn_every_n_layers", 3)
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention" if i % every else "full_attention"
                                                  for i in range(cfg.num_hidden_layers)]
    rope = getattr(cfg, "rope_parameters", None) or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    theta = full.pop("rope_theta", None) or getattr(cfg, "global_rope_theta", None) or 160000.0
    local_theta = local.pop("rope_theta", None) or getattr(cfg, "local_rope_theta", None) or 10000.0
    if full != local:
        raise ValueError(f"ModernBERT with different rope scaling for global ({full}) and local ({local}) "
                         "layers is not supported")
    scaling = full if full.get("rope_type", "default") != "default" else None
    pooling = getattr(cfg, "classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"unsupported classifier_pooling {pooling!r} (cls or mean)")
    heads = cfg.num_attention_heads
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
                head_dim=cfg.hidden_size // heads, rms_norm_eps=cfg.norm_eps, rope_theta=float(theta),
                rope_scaling=scaling, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=False, attention_bias=bool(cfg.attention_bias), mlp_bias=bool(cfg.mlp_bias),
                o_proj_bias=bool(cfg.attention_bias), local_window=getattr(cfg, "local_attention", 128) // 2,
                num_labels=_encoder_labels(cfg), token_classifier=is_token_classifier(cfg), encoder=True,
                hidden_act=cfg.hidden_activation, modernbert=True, norm_bias=bool(cfg.norm_bias),
                local_rope_theta=float(local_theta),
                sliding_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
                classifier_pooling=pooling.upper(), classifier_bias=bool(getattr(cfg, "classifier_bias", False)),
                classifier_act=getattr(cfg, "classifier_activation", "gelu"))


def _encoder_labels(cfg) -> int:
    """An encoder's classes: a sequence classifier's or a token classifier's; 0 for neither."""
    return cfg.num_labels if has_classifier_head(cfg) else 0
