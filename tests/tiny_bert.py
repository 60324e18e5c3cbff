"""Tiny random encoder checkpoints (BERT and ModernBERT with a WordPiece tokenizer, RoBERTa and
XLM-RoBERTa with a byte-level BPE one trained here), saved as HF saves them, optionally as
sentence-transformers folders."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the", "a", "capital", "of", "france", "is", "paris", "what", "city", "river", "cat", "dog", "runs",
         "fast", "slow", "blue", "sky", "sea", "who", "wrote", "book", "and", "in", "on", "for", "with")
CORPUS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]


def _bert_tokenizer(out_dir: Path, token_types: bool = True):
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *".,?!", *letters, *(f"##{c}" for c in letters),
             *(w for w in WORDS if w not in letters)]
    (out_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    return BertTokenizerFast(str(out_dir / "vocab.txt"), model_max_length=128, model_input_names=names)


def _roberta_tokenizer(out_dir: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False)
    vocab, merges = bpe.save_model(str(out_dir))
    return RobertaTokenizerFast(vocab, merges, model_max_length=128)


def make_tiny_encoder(out_dir: Path, kind: str = "bert", num_labels: int = 0, pooling: str | None = None,
                      normalize: bool = True, max_seq_length: int | None = None, seed: int = 0,
                      per_token: bool = False, **config) -> Path:
    """kind "bert", "distilbert" (no token types), "nomic_bert" (transformers' NomicBert:
    nomic_hub_format turns it into nomic's own), "gte" (transformers' Gte: gte_hub_format turns
    it into the hub's), "modernbert" (BERT's tokenizer, without token types: ModernBERT has none;
    a local window of 8 tokens, so that short prompts cross it), "roberta" or "xlm-roberta" (both
    with RoBERTa's byte-level BPE tokenizer);
    `num_labels` > 0: a ...ForSequenceClassification (`per_token`: a ...ForTokenClassification); `pooling`
    ("cls_token", "mean_tokens", ...): a sentence-transformers folder pooling so (with a Normalize
    module where `normalize`, and `max_seq_length` in its sentence_bert_config.json)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

    out_dir.mkdir(parents=True, exist_ok=True)
    bert_vocab = kind in ("bert", "distilbert", "nomic_bert", "modernbert", "gte")
    # token types where the model has them: ModernBERT and DistilBERT have none, nor a GTE of one
    # type (gte-multilingual's)
    token_types = kind not in ("modernbert", "distilbert") and (kind != "gte" or config.get("type_vocab_size", 2) >= 2)
    tok = _bert_tokenizer(out_dir, token_types) if bert_vocab else _roberta_tokenizer(out_dir)
    torch.manual_seed(seed)
    if kind == "modernbert":
        shape = {"num_hidden_layers": 3, "max_position_embeddings": 128, "local_attention": 8,
                 "global_attn_every_n_layers": 2, "pad_token_id": 0, "cls_token_id": 2, "sep_token_id": 3,
                 "bos_token_id": 2, "eos_token_id": 3}
    elif kind in ("bert", "nomic_bert", "gte"):
        shape = {"num_hidden_layers": 2, "max_position_embeddings": 128, "type_vocab_size": 2, "pad_token_id": 0}
    elif kind == "distilbert":  # its own names for the sizes
        shape = {"n_layers": 2, "hidden_dim": 128, "max_position_embeddings": 128, "pad_token_id": 0}
    else:
        shape = {"num_hidden_layers": 2, "max_position_embeddings": 130, "type_vocab_size": 1, "pad_token_id": 1,
                 "bos_token_id": 0, "eos_token_id": 2}
    cfg = AutoConfig.for_model(kind, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               **{**shape, **config})
    if num_labels:
        cfg.num_labels = num_labels
        model = (AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification).from_config(cfg)
    else:
        model = AutoModel.from_config(cfg)
    with torch.no_grad():  # not HF's init: biases and norms read wrongly would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.startswith(("classifier", "head.")) or "pooler" in name:  # scores that differ, pair to pair
                p.normal_(0, 0.5)
            elif "LayerNorm.weight" in name or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (out_dir / "modules.json").write_text(json.dumps(modules))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}))
        if max_seq_length is not None:
            (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                            "do_lower_case": False}))
    return out_dir


def hf_encode(model_dir: Path, texts: list, pooling: str = "cls_token") -> torch.Tensor:
    """HF's vectors (unnormalised) or, for a classifier, logits: each text (or pair) alone, as
    sentence-transformers pools them."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    classify = any(a.endswith("ForSequenceClassification") for a in config["architectures"])
    model = (AutoModelForSequenceClassification if classify else AutoModel).from_pretrained(str(model_dir)).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tok(*text, return_tensors="pt") if isinstance(text, tuple) else tok(text, return_tensors="pt")
            result = model(**enc)
            if classify:
                out.append(result.logits[0])
                continue
            h = result.last_hidden_state[0]
            out.append({"cls_token": h[0], "mean_tokens": h.mean(dim=0), "lasttoken": h[-1]}[pooling])
    return torch.stack(out)


def gte_hub_format(src: Path, dst: Path, ntk_factor: float | None = None, sparse_head: bool = False,
                   model_type: str = "new") -> Path:
    """A copy of a transformers Gte folder with the hub's config (model_type "new", read by
    Alibaba-NLP's remote code; gte-base-en-v1.5's fields) and its classifier's tensor names
    ("new." for "gte."; the other names transformers saves as the hub has them already).
    `ntk_factor`: the source's rotary is "linear" by ntk_factor^(2/head_dim) at ntk_factor times
    the hub's theta, which the hub writes as its fixed NTK scaling by ntk_factor. `sparse_head`:
    as gte-multilingual-base, a NewForTokenClassification without labels whose one-row
    `classifier` gives sparse token weights. `model_type` "gte": Snowflake's form of the config."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    theta, scaling = rope["rope_theta"], None
    if ntk_factor is not None:
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        assert rope["rope_type"] == "linear" and abs(rope["factor"] - ntk_factor ** (2 / head_dim)) < 1e-12
        theta, scaling = theta / ntk_factor, {"type": "ntk", "factor": ntk_factor}
    hub = {**cfg, "model_type": "new", "architectures": [a.replace("Gte", "New") for a in cfg["architectures"]],
           "rope_theta": theta, "rope_scaling": scaling, "position_embedding_type": "rope",
           "layer_norm_type": "layer_norm", "pack_qkv": True, "unpad_inputs": False,
           "use_memory_efficient_attention": False, "logn_attention_scale": False, "logn_attention_clip1": False,
           "auto_map": {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
                        "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"}}
    if sparse_head:
        hub["architectures"] = ["NewForTokenClassification"]
        hub.pop("id2label", None), hub.pop("label2id", None)
    if model_type == "gte":  # Snowflake's: its architectures keep transformers' names (GteModel)
        hub["architectures"] = cfg["architectures"]
    hub["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(hub))
    weights = load_file(str(src / "model.safetensors"))
    if sparse_head:
        weights |= {"classifier.weight": torch.randn(1, cfg["hidden_size"]), "classifier.bias": torch.zeros(1)}
    save_file({("new." + k.removeprefix("gte.")) if k.startswith("gte.") else k: v for k, v in weights.items()},
              str(dst / "model.safetensors"))
    return dst


def nomic_hub_format(src: Path, dst: Path) -> Path:
    """A copy of a transformers NomicBertModel folder with nomic's own config (nomic-embed-text-v1.5's:
    GPT-2 names, n_embd, n_layer, rotary_emb_base, ...; trained to 96 positions here) in place of
    transformers' NomicBertConfig. transformers saves the weights under nomic's names already
    (emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11, ...), so the vectors are the same."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    hub = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "activation_function": "swiglu",
           "n_embd": cfg["hidden_size"], "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
           "n_inner": cfg["intermediate_size"], "n_positions": 8192, "max_trained_positions": 96,
           "layer_norm_epsilon": cfg["layer_norm_eps"], "rotary_emb_base": cfg["rope_parameters"]["rope_theta"],
           "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_scaling_factor": None,
           "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False,
           "type_vocab_size": cfg["type_vocab_size"], "vocab_size": cfg["vocab_size"], "pad_token_id": 0,
           "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig"}}
    (dst / "config.json").write_text(json.dumps(hub))
    return dst
