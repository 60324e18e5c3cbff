"""A sentence-transformers folder's tokenizer settings (`sentence_bert_config.json`, or the file
of its model's kind, such as `sentence_xlm-roberta_config.json`, as vLLM looks for them):

    max_seq_length   the longest input the model was trained for (all-MiniLM-L6-v2's 256 of
                     BERT's 512 positions): an encoder's max_model_len stops there
    do_lower_case    the text is lower-cased before it is tokenized (sentence-transformers'
                     Transformer module does so): `lower_cased` makes the tokenizer do it

(The folder's modules.json: engine.pooling and engine.st_dense.)"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# sentence-transformers names the file after the model's kind; vLLM's order
CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                "sentence_camembert_config.json", "sentence_albert_config.json",
                "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")


# Unicode's Final_Sigma condition, as str.lower() applies it: a capital sigma after a cased letter
# (with up to 8 case-ignorable characters between: each alternative of a lookbehind has a fixed
# length, and a variable one is slow) and not before one
_CASE_IGNORABLE, _CASED = r"\p{Case_Ignorable}", r"[\p{Cased}&&\P{Case_Ignorable}]"
_FINAL_SIGMA = (f"(?<={'|'.join(_CASED + _CASE_IGNORABLE * k for k in range(9))})Σ"
                f"(?!{_CASE_IGNORABLE}*{_CASED})")


def tokenizer_settings(model_dir: str | Path) -> dict:
    """The first of CONFIG_FILES the folder has, read; {} without one (or an unreadable one:
    what it would set is then left at the model's own)."""
    for name in CONFIG_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            logger.warning("ignoring %r, which cannot be read: %s", str(path), e)
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def max_seq_length(model_dir: str | Path) -> int | None:
    value = tokenizer_settings(model_dir).get("max_seq_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def lower_cased(tokenizer, model_dir: str | Path):
    """The tokenizer, lower-casing every text it encodes first where the folder says
    do_lower_case (as sentence-transformers and vLLM lower-case a prompt): a Lowercase step ahead
    of its normalizer, so the engine, the ingress and `LLM` all encode as the model was trained.
    Special tokens written in a text ("[SEP]") are still found, as the tokenizer finds them before
    normalizing. Decoding is unchanged. Python's str.lower() gives a word-final capital sigma its
    final form (ς), which the Lowercase step alone does not: _FINAL_SIGMA does that first."""
    if tokenizer_settings(model_dir).get("do_lower_case") is not True:
        return tokenizer
    from tokenizers import Regex, normalizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{str(model_dir)!r} is a sentence-transformers folder whose texts are lower-cased "
                         "(do_lower_case), but its tokenizer has no tokenizers backend to lower-case them with")
    steps = [normalizers.Replace(Regex(_FINAL_SIGMA), "ς"), normalizers.Lowercase()]
    backend.normalizer = normalizers.Sequence(steps + ([backend.normalizer] if backend.normalizer is not None else []))
    logger.info("tokenizer: texts are lower-cased before encoding (sentence-transformers do_lower_case)")
    return tokenizer
