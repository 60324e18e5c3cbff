"""The ModelArch fields of an encoder's config (engine.model.bert's BERT, RoBERTa, XLM-RoBERTa and
NomicBERT; engine.model.modernbert's ModernBERT), as transformers reads the config.json."""
from __future__ import annotations

from engine.classifier import has_classifier_head, is_token_classifier


def encoder_fields(cfg) -> dict:
    """ModelArch's fields for an encoder's config; ValueError for what the engine does not run."""
    if cfg.model_type == "modernbert":
        return _modernbert(cfg)
    if cfg.model_type == "nomic_bert":
        return _nomic(cfg)
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
                bert_pooler=cfg.model_type == "bert")

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
                type_vocab_size=cfg.type_vocab_size, hidden_act=act, bert_pooler=True, rotary=True, gated_mlp=True)

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
