"""Sequence classifiers: a Llama-family checkpoint saved as `...ForSequenceClassification` (a
cross-encoder reranker, a reward model, a sentiment head) has a `score` head over its last
token's final hidden state instead of a language-model head. The pooling runner serves it
(engine.pooling) for vLLM's tasks:

    classify   the head's probabilities over its labels (HF's problem_type rules, as vLLM reads
               them): a softmax; a sigmoid with one label or for a multi-label problem; the
               logits as they are for a regression
    score      a cross-encoder's (one label): its activated logit for a pair of texts in one
               prompt (engine.scoring.pair_prompt); the activation its sentence-transformers
               config names, else classify's

An encoder saved as `...ForTokenClassification` (a named-entity tagger) has its head over every
token instead, for vLLM's task `token_classify`: each token's probabilities over the labels, by
classify's rule.

A request's `use_activation: false` takes the logits as they are. Nothing here imports torch at
import time: the ingress reads these names too."""
from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("normalize", "softmax", "sigmoid")  # what a resolved request applies (None: nothing)


def is_classifier(hf_config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def is_token_classifier(hf_config) -> bool:
    return any(a.endswith("ForTokenClassification") for a in getattr(hf_config, "architectures", None) or [])


def has_classifier_head(hf_config) -> bool:
    """A sequence or a token classifier: its head has `num_labels` outputs."""
    return is_classifier(hf_config) or is_token_classifier(hf_config)


@dataclass(frozen=True)
class Classifier:
    num_labels: int
    labels: tuple[str, ...]  # the config's id2label, by id
    classify_activation: str | None
    score_activation: str | None
    use_pad_token: bool = True  # a pair's prompt is the tokenizer's pair encoding; False: the two texts joined
    per_token: bool = False  # a token classifier's: every token's labels

    @property
    def tasks(self) -> tuple[str, ...]:
        if self.per_token:
            return ("token_classify",)
        return ("classify", "score") if self.num_labels == 1 else ("classify",)

    @property
    def kind(self) -> str:
        return (f"a {'token' if self.per_token else 'sequence'} classifier with {self.num_labels} "
                f"label{'' if self.num_labels == 1 else 's'}")

    def activation(self, task: str) -> str | None:
        return self.score_activation if task == "score" else self.classify_activation

    def label(self, probs: list[float]) -> str:
        """The label of the most probable class (the first of a tie)."""
        return self.labels[max(range(len(probs)), key=probs.__getitem__)]


def classifier(hf_config) -> Classifier:
    """The head a classifier checkpoint's config describes; ValueError for an activation this
    engine does not apply."""
    n = int(hf_config.num_labels)
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        classify = None
    else:
        classify = "sigmoid" if n < 2 or problem == "multi_label_classification" else "softmax"
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(n))
    return Classifier(n, labels, classify, _cross_encoder_activation(hf_config, n, classify),
                      bool(getattr(hf_config, "use_pad_token", True)), is_token_classifier(hf_config))


def _cross_encoder_activation(hf_config, num_labels: int, default: str | None) -> str | None:
    """What sentence-transformers' CrossEncoder applies to a pair's logit, where the config says
    (a Sigmoid or Softmax it names: vLLM's classify rule by the labels alone, whatever the
    problem_type); else `default`, classify's."""
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return default
    kind = str(name).rsplit(".", 1)[-1]
    if kind == "Identity":
        return None
    if kind in ("Sigmoid", "Softmax"):
        return "sigmoid" if num_labels < 2 else "softmax"
    raise ValueError(f"the model's config names the cross-encoder activation {name!r}, which kvserve does not "
                     "apply (it applies Identity, Sigmoid and Softmax)")


def activated(v, activation: str | None):
    """A pooled vector (a torch tensor) with `activation` (ACTIVATIONS, or None) applied."""
    import torch

    if activation is None:
        return v
    if activation == "normalize":
        return torch.nn.functional.normalize(v, p=2, dim=-1)
    if activation == "softmax":
        return torch.softmax(v, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(v)
    raise ValueError(f"unknown activation {activation!r}")
