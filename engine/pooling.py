"""Pooling: an engine started with vLLM's `--runner pooling` turns each prompt into one vector
(embeddings: `LLM.embed`, `/v1/embeddings`) instead of generating from it.

    runner     generate | pooling; `auto` pools a sentence-transformers folder (modules.json), an
               architecture named for embeddings (`...EmbeddingModel`, or a bare `LlamaModel`
               / `Qwen3Model` without a language-model head) or a sequence classifier
               (`...ForSequenceClassification`), as vLLM resolves it
    tasks      an embedding model pools for `embed` and `token_embed` (a vector for every
               prompt token: vLLM's ALL pooling, as late-interaction retrieval reads them); a
               classifier for `classify` (its head's probabilities, engine.classifier) and, with
               one label, `score` (a cross-encoder: one pair of texts in one prompt,
               engine.scoring); an encoder's token classifier for `token_classify` (each token's
               probabilities)
    pooler     vLLM's PoolerConfig: LAST pooling, the final hidden state (after the last norm) of
               the prompt's last token, or MEAN, the mean of every prompt token's; L2-normalised
               (`use_activation`) unless the model's sentence-transformers modules have no
               Normalize step or the request says otherwise

LAST is what decoder embedding models are trained for (Qwen3-Embedding, e5-mistral, gte-Qwen2,
SFR-Embedding) and vLLM's default for them; MEAN is what some sentence-transformers folders say.
CLS is refused for a decoder: the first token's state carries nothing of the rest under causal
attention. An encoder (BERT, RoBERTa, DistilBERT, NomicBERT, GTE: engine.model.bert; ModernBERT:
engine.model.modernbert) pools CLS by default, or MEAN or LAST, in the model itself, each prompt
whole in one step.

A pooling request rides the generation path whole (scheduler, chunked prefill, prefix cache,
tensor parallelism, the replica and process hops): its SamplingParams carry `pooling`, the
sequence "samples" once, at the end of its prefill, from the hidden row where a generating one
would take logits, and what it draws is that row (`Pooled`); the engine then finishes it with
its vector (`embedding`) and its blocks go back. A MEAN request also takes the rows before its
last, as prompt logprobs take theirs (Sequence.prompt_logprob_positions, no prefix-cache hit past
the rows it has), and the engine adds up their sums (`prompt_rows`) as its chunks run; a
`token_embed` request (ALL) takes the same rows and keeps each. A LAST request's prefix-cache hit
is safe: the last prompt token is always computed.
"""
from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.classifier import Classifier, activated, classifier, has_classifier_head, is_classifier, is_token_classifier
from engine.errors import InvalidRequestError
from engine.st_dense import ST_NORMALIZE, ST_POOLING, read_dense_modules
from engine.vllm_args import json_dict

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("LAST", "MEAN")  # what this engine pools a decoder by; vLLM's others are refused by name
ENCODER_POOLING_TYPES = ("CLS", "MEAN", "LAST")  # an encoder's (engine.model.bert)
TASKS = ("embed", "classify", "score", "token_embed", "token_classify")  # vLLM's pooling tasks that this engine serves
VLLM_POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")


@dataclass
class PoolingParams:
    """vLLM's, for `LLM.embed` / `LLM.encode`: `dimensions` keeps the first k of a Matryoshka
    model's embedding (then normalises, as vLLM); `use_activation` (embed: L2-normalise) defaults
    to the pooler's; `truncate_prompt_tokens` keeps the prompt's first k tokens (vLLM's pooling side)."""
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    pooling_type: str | None = None  # the engine's, set when it takes the request (PoolerConfig.resolved)
    activation: str | None = None  # the engine's too: what `use_activation` applies (ACTIVATIONS), or None
    # a cross-encoder pair's (engine.scoring.pair_prompts): the index where its second text's
    # token type (1) begins, as the tokenizer's token_type_ids; None: every token type 0
    token_type_start: int | None = None

    @property
    def pools_every_row(self) -> bool:
        """MEAN and ALL: the request needs every prompt row's hidden state, not the last one's alone."""
        return self.pooling_type in ("MEAN", "ALL")

    @property
    def every_token(self) -> bool:
        """ALL (`token_embed`): a vector for each prompt token."""
        return self.pooling_type == "ALL"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError("task", f"pooling task {self.task!r} is not supported: kvserve pools for "
                                      f"{', '.join(TASKS)}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError("dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError("use_activation", f"use_activation must be true or false, "
                                      f"got {self.use_activation!r}")
        if self.truncate_prompt_tokens is not None and (isinstance(self.truncate_prompt_tokens, bool) or not isinstance(
                self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < -1):
            raise InvalidRequestError("truncate_prompt_tokens", "truncate_prompt_tokens must be an integer >= -1, "
                                      f"got {self.truncate_prompt_tokens!r}")
        if self.token_type_start is not None and (isinstance(self.token_type_start, bool) or not isinstance(
                self.token_type_start, int) or self.token_type_start < 0):
            raise InvalidRequestError("token_type_start", "token_type_start must be an integer >= 0, "
                                      f"got {self.token_type_start!r}")

    def sampling(self):
        """The SamplingParams a pooling request runs with: one 'draw', at the end of its prefill."""
        from engine.sampling_params import RequestOutputKind, SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=self,
                              truncate_prompt_tokens=self.truncate_prompt_tokens,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass(frozen=True)
class PoolerConfig:
    """How an engine pools (vLLM's --pooler-config, with what the model folder says under it)."""
    seq_pooling_type: str = "LAST"
    use_activation: bool = True  # L2-normalise, unless a request says otherwise
    dimensions: int | None = None  # a request's default `dimensions`
    embedding_size: int = 0  # what a vector has without `dimensions`: the hidden size, or the Dense modules' output
    matryoshka: bool = False  # the model's config says its leading dimensions embed on their own
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only sizes allowed, where it lists them
    classifier: Classifier | None = None  # a classifier's head (engine.classifier); None: it embeds
    # An encoder (engine.model.bert) pools in the model, by seq_pooling_type: a request takes the
    # one row it gives, as LAST takes the last one
    encoder: bool = False

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("embed", "token_embed") if self.classifier is None else self.classifier.tasks

    @classmethod
    def from_fields(cls, fields: dict) -> "PoolerConfig":
        """The config from its `dataclasses.asdict` fields (an engine's info, as the router gets it)."""
        head = fields.get("classifier")
        if isinstance(head, dict):
            head = Classifier(**{**head, "labels": tuple(head["labels"])})
        dims = fields.get("matryoshka_dimensions")
        return cls(**{**fields, "classifier": head, "matryoshka_dimensions": None if dims is None else tuple(dims)})

    def resolved(self, params: PoolingParams) -> PoolingParams:
        """A request's params with the engine's defaults filled in; InvalidRequestError for a task
        or a `dimensions` this model cannot give (vLLM's checks and words)."""
        if params.task not in self.tasks:
            raise InvalidRequestError("task", f"Task {params.task} is not supported by this model: it pools for "
                                      f"{', '.join(self.tasks)}" + ("" if self.classifier is None else
                                                                    f" (it is {self.classifier.kind})"))
        dims = params.dimensions if params.dimensions is not None else self.dimensions
        if self.classifier is not None:
            if params.dimensions is not None:
                raise InvalidRequestError("dimensions", "dimensions is for embeddings; this model classifies")
            use = params.use_activation if params.use_activation is not None else self.use_activation
            act = self.classifier.activation(params.task) if use else None
            return PoolingParams(None, act is not None, params.truncate_prompt_tokens, params.task,
                                 self.request_pooling, act, params.token_type_start)
        act = params.use_activation if params.use_activation is not None else self.use_activation
        if dims is not None:
            if not self.matryoshka:
                raise InvalidRequestError("dimensions", "the model does not support Matryoshka embeddings; "
                                          f"dimensions must be unset (received dimensions={dims})")
            if not 1 <= dims <= self.embedding_size:
                raise InvalidRequestError("dimensions", f"the model only supports dimensions in range "
                                          f"[1, {self.embedding_size}], got {dims}")
            if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
                raise InvalidRequestError("dimensions", f"the model only supports dimensions "
                                          f"{list(self.matryoshka_dimensions)}, got {dims}")
        return PoolingParams(dims, act, params.truncate_prompt_tokens, params.task,
                             "ALL" if params.task == "token_embed" else self.request_pooling,
                             "normalize" if act else None, params.token_type_start)

    @property
    def request_pooling(self) -> str:
        """How a request reads the rows the model gives: an encoder's one row is already pooled."""
        return "LAST" if self.encoder else self.seq_pooling_type


def parse_pooler_config(value) -> dict:
    """--pooler-config (a dict, or its JSON) -> the PoolerConfig fields it sets; ValueError naming
    what is not taken."""
    if value is None:
        return {}
    value = dict(json_dict("pooler_config", value))
    if "normalize" in value:  # vLLM 0.32's words
        raise ValueError("pooler_config: `normalize` was removed; use `use_activation` instead")
    if "pooling_type" in value:
        if "seq_pooling_type" in value:
            raise ValueError("pooler_config: give pooling_type or seq_pooling_type, not both")
        value["seq_pooling_type"] = value.pop("pooling_type")
    out = {}
    for key, v in value.items():
        if v is None:
            continue
        if key == "seq_pooling_type":
            kind = str(v).upper()
            if kind not in VLLM_POOLING_TYPES:
                raise ValueError(f"pooler_config: unknown pooling type {v!r} (vLLM's: {', '.join(VLLM_POOLING_TYPES)})")
            out[key] = kind
        elif key == "use_activation":
            if not isinstance(v, bool):
                raise ValueError(f"pooler_config: use_activation must be true or false, got {v!r}")
            out[key] = v
        elif key == "dimensions":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"pooler_config: dimensions must be a positive integer, got {v!r}")
            out[key] = v
        elif key == "task":  # checked against the model's tasks in pooler_config
            if v not in TASKS:
                raise ValueError(f"pooler_config: task {v!r} is not supported (kvserve pools for {', '.join(TASKS)})")
            out[key] = v
        else:
            raise ValueError(f"pooler_config: {key!r} is not supported here (kvserve takes pooling_type, "
                             "seq_pooling_type, use_activation, dimensions, task)")
    return out


def sentence_transformers_pooling(model_dir: Path) -> dict | None:
    """What a sentence-transformers folder's modules.json (and its Pooling module's config) set:
    the pooling type and whether a Normalize step follows (vLLM's reading); None without a
    Pooling module. (Its Dense modules: engine.st_dense.)"""
    path = Path(model_dir) / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        pooling = next((m for m in modules if m.get("type") in ST_POOLING), None)
        normalize = any(m.get("type") in ST_NORMALIZE for m in modules)
        cfg_path = Path(model_dir) / pooling.get("path", "") / "config.json" if pooling is not None else None
        cfg = json.loads(cfg_path.read_text()) if cfg_path is not None and cfg_path.is_file() else {}
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"cannot read the sentence-transformers modules in {str(model_dir)!r}: {e}") from None
    if pooling is None:
        return None
    out: dict = {"use_activation": normalize}
    for key, v in cfg.items():  # the first mode it sets; one kvserve lacks (weightedmean, max) is refused later
        if key == "pooling_mode" and isinstance(v, str):
            mode = v
        elif key.startswith("pooling_mode_") and v is True:
            mode = key.removeprefix("pooling_mode_")
        else:
            continue
        if mode.startswith("mean_sqrt_len") and not normalize and "seq_pooling_type" not in out:  # the sum over sqrt(count): MEAN, scaled
            raise ValueError(f"{str(path)!r} pools by mean_sqrt_len_tokens without a Normalize step, which kvserve "
                             "does not implement (with one, it is MEAN's vector)")
        out.setdefault("seq_pooling_type", "LAST" if "lasttoken" in mode else mode.split("_", 1)[0].upper())
    return out


def resolve_runner(runner: str, convert: str, model_dir: Path, hf_config) -> str:
    """--runner / --convert -> "generate" or "pooling", as vLLM resolves them for this folder."""
    from engine.model_source import ENCODER_MODEL_TYPES  # not at import: `python -m engine.model_source` runs it

    if runner != "auto":
        return runner
    if getattr(hf_config, "model_type", None) in ENCODER_MODEL_TYPES:
        return "pooling"
    if convert == "embed":
        return "pooling"
    if sentence_transformers_pooling(model_dir) is not None:
        return "pooling"
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch.endswith(("ForCausalLM", "LMHeadModel", "ChatModel", "ForConditionalGeneration")):
            return "generate"
        if arch.endswith(("EmbeddingModel", "ForTextEncoding", "ForSequenceClassification")) or arch.endswith("Model"):
            return "pooling"
    return "generate"


def _embedding_size(model_dir: Path, hidden_size: int, classifier: bool) -> int:
    """A vector's size: the hidden size, or the last sentence-transformers Dense module's output
    (engine.st_dense, which the engine applies after pooling)."""
    dense = read_dense_modules(model_dir)
    if not dense:
        return hidden_size
    if classifier:
        raise ValueError(f"{str(dense[0].folder)!r} is a sentence-transformers Dense module, which a sequence "
                         "classifier's scores would not go through")
    if dense[0].in_features != hidden_size:
        raise ValueError(f"the Dense module in {str(dense[0].folder)!r} takes {dense[0].in_features} features; the "
                         f"model's pooled vectors have {hidden_size}")
    return dense[-1].out_features


def _head_reads(hf_config, encoder: bool) -> str:
    """The pooling a model gets by default, whose state a classifier's head reads: a decoder's
    last token; an encoder's first ([CLS]), or as a ModernBERT classifier's config says
    (classifier_pooling cls or mean; it says nothing for an embedding model, which pools CLS)."""
    if not encoder:
        return "LAST"
    if hf_config.model_type == "modernbert" and is_classifier(hf_config):
        return str(getattr(hf_config, "classifier_pooling", "cls")).upper()
    return "CLS"


def pooler_config(runner: str, convert: str, value, model_dir: Path, hf_config) -> PoolerConfig | None:
    """The engine's PoolerConfig, or None for a generating one. --pooler-config wins over the
    folder's sentence-transformers modules, which win over the defaults (LAST, normalised)."""
    from engine.model_source import ENCODER_MODEL_TYPES, ENCODER_NAMES

    encoder = getattr(hf_config, "model_type", None) in ENCODER_MODEL_TYPES
    if is_token_classifier(hf_config) and not encoder:
        raise ValueError(f"a ...ForTokenClassification checkpoint is served for encoders ({ENCODER_NAMES}) only: "
                         "kvserve has no per-token head for a decoder")
    if resolve_runner(runner, convert, model_dir, hf_config) != "pooling":
        if encoder:
            raise ValueError(f"an encoder model ({ENCODER_NAMES}) has no language-model head to "
                             "generate with: it serves embeddings and scores; serve it with --runner pooling")
        if is_classifier(hf_config):
            raise ValueError("this checkpoint is a sequence classifier (...ForSequenceClassification): it has no "
                             "language-model head to generate with; serve it with --runner pooling")
        if value is not None:
            logger.warning("--pooler-config has no effect: the model runs for generation (--runner pooling pools)")
        return None
    if not encoder and getattr(hf_config, "is_causal", True) is False:  # vLLM runs such a model's attention both ways
        raise ValueError("the model's config sets is_causal false (attention over the whole input, both ways): "
                         "kvserve's attention is causal only, and would embed it wrongly")
    fields = {**(sentence_transformers_pooling(model_dir) or {}), **parse_pooler_config(value)}
    head_reads = _head_reads(hf_config, encoder)  # the state a classifier's head reads
    kind = fields.get("seq_pooling_type", head_reads)
    head = classifier(hf_config) if has_classifier_head(hf_config) else None
    if head is not None and head.per_token:  # it reads every token: no pooling type applies
        if "dimensions" in fields:
            raise ValueError("dimensions is for embeddings: a token classifier gives each token's probabilities")
        kind = head_reads
    if head is not None and (kind != head_reads or "dimensions" in fields):
        reads = {"CLS": "its first token's state", "MEAN": "the mean of its tokens' states"}.get(
            head_reads, "its last token's state")
        raise ValueError(f"a sequence classifier scores {reads}, whole: {kind} pooling or dimensions would give its "
                         "head inputs it was not trained on")
    if encoder and kind not in ENCODER_POOLING_TYPES:
        raise ValueError(f"pooling type {kind} is not supported for encoders: kvserve pools the first token (CLS), "
                         "the mean of all (MEAN) or the last (LAST)")
    if not encoder and kind not in POOLING_TYPES:
        raise ValueError(f"pooling type {kind} is not supported: kvserve pools the last token (LAST) or the mean "
                         "of all (MEAN); a CLS token's state means something only under attention both ways. Set "
                         "--pooler-config '{\"pooling_type\": \"LAST\"}' to pool this model so anyway")
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    config = PoolerConfig(kind, fields.get("use_activation", True), fields.get("dimensions"),
                          _embedding_size(model_dir, hf_config.hidden_size, head is not None),
                          bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
                          tuple(dims) if dims else None, head, encoder)
    if fields.get("task", config.tasks[0]) not in config.tasks:  # vLLM refuses it at start-up too
        raise ValueError(f"pooler_config: task {fields['task']!r} is not supported by this model: it is "
                         f"{'an embedding model' if head is None else head.kind}, which pools for "
                         f"{', '.join(config.tasks)}")
    if head is not None:
        logger.info("pooling runner: %s, for %s", head.kind, ", ".join(head.tasks))
        return config
    if config.dimensions is not None:
        config.resolved(PoolingParams())  # a default the model cannot give: refused now, not per request
    logger.info("pooling runner: %s pooling, %s, %d dimensions", kind,
                "normalised" if config.use_activation else "not normalised", config.dimensions or config.embedding_size)
    return config


@dataclass(frozen=True, slots=True)
class Pooled:
    """What a pooling sequence 'draws' at the end of its prefill: its last prompt token's final
    hidden state (a classifier's: its head's logits over it), as the model gave it (float32);
    Request.finish_pooled makes the vector."""
    data: list[float]


def pool(hidden, rows: list[int]) -> list[Pooled]:
    """hidden: (R, hidden) float32 tensor, the final hidden states of the sequences' last prompt
    tokens (or an encoder's list of R tensors: a pooled row (hidden,), or every token's rows
    (tokens, hidden or labels) for `token_embed` and a token classifier) -> the draws, the i-th of
    row rows[i]. One copy to the host."""
    if isinstance(hidden, list):  # one copy of them all, then each prompt's rows
        import torch

        flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden]).tolist()
        ends = list(itertools.accumulate(len(h) if h.dim() == 2 else 1 for h in hidden))
        values = [flat[end - len(h):end] if h.dim() == 2 else flat[end - 1] for h, end in zip(hidden, ends)]
    else:
        values = hidden.tolist()
    return [Pooled(values[r]) for r in rows]


def prompt_rows(hidden, spans: list, every_token: set[int]) -> dict[int, tuple[list, int]]:
    """A pooling step's prompt rows (hidden: (M, hidden), engine.prompt_logprobs.PromptSpan's
    order) -> span index -> (their sum in float64, for MEAN; the rows themselves for the span
    indexes in `every_token`, ALL's; and their count). One copy to the host."""
    import torch

    parts, row = [], 0
    for s in spans:
        rows = hidden[row:row + s.num_rows]
        parts.append(rows.double() if s.index in every_token else rows.sum(dim=0, dtype=torch.float64)[None])
        row += s.num_rows
    values = torch.cat(parts).tolist() if parts else []
    out, row = {}, 0
    for s, part in zip(spans, parts):
        out[s.index] = (values[row:row + len(part)] if s.index in every_token else values[row], s.num_rows)
        row += len(part)
    return out


def pooled_vector(last: list[float], params: PoolingParams, rows_sum: list[float] | None = None,
                  num_rows: int = 0, project=None) -> list[float]:
    """The vector of a request (`params` resolved): its last row (LAST), or the mean of
    `rows_sum` (its other rows) and the last (MEAN); or, `last` a list of rows (ALL, a token
    classifier's), a vector for each; through `project` (engine.st_dense's Projection, where the
    folder has Dense modules); its first `dimensions`, with its `activation` applied (vLLM's
    order: project, cut, then normalise), each row alone."""
    import torch  # not at import: EngineConfig reads this module's names, and the ingress has no use for torch

    v = torch.tensor(last, dtype=torch.float64)
    if params.pooling_type == "MEAN":
        v = (v + torch.tensor(rows_sum, dtype=torch.float64)) / (num_rows + 1) if rows_sum is not None else v
    if project is not None:  # an embedding model's (a classifier with Dense modules is refused)
        v = project(v)
    if params.dimensions is not None:
        v = v[..., :params.dimensions]
    return activated(v, params.activation).float().tolist()
