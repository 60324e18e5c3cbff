"""vLLM's score and rerank APIs, on a pooling engine (`--runner pooling`): POST /score (and
/v1/score) scores text pairs, POST /rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's
shape) orders documents by their relevance to a query. An embedding model embeds every text
once, as /v1/embeddings does, and scores a pair by the cosine similarity of its vectors; a
cross-encoder reads each pair as one prompt and scores it with its head (engine.scoring).

The request bodies and replies are here; OpenAIServing runs them."""
from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from engine.scoring import score_pairs
from router.protocol import TEMPLATE_ARGUMENTS, PoolingFields, nulls_dropped

# An empty text is taken, as vLLM takes it: an encoder frames it, and one that tokenizes to
# nothing is a 400 saying the prompt is empty (OpenAIServing._check_prompts)
Texts = str | list[str]

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")

# vLLM's names for a score request's two sides; a body gives exactly one pair
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoringFields(PoolingFields):
    """What /score and /rerank share (vLLM's ScoringRequestMixin): each side's texts cut to their
    first N tokens (0: whole; Cohere's max_tokens_per_doc), and variables for a cross-encoder's
    score template (the server's --chat-template), `instruction` among them."""
    max_tokens_per_query: int = Field(0, ge=0)
    max_tokens_per_doc: int = Field(0, ge=0)
    instruction: str | None = None  # vLLM's: chat_template_kwargs' "instruction", which wins over it
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _whole_for_nulls(cls, data):  # a client's null: no cut
        return nulls_dropped(data, frozenset({"max_tokens_per_query", "max_tokens_per_doc"}))

    def side_limits(self) -> tuple[int | None, int | None]:
        """The tokens each side's texts keep (None: all of them)."""
        return self.max_tokens_per_query or None, self.max_tokens_per_doc or None

    @model_validator(mode="after")
    def _template_variables(self):
        taken = sorted(TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or ()))
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        return self

    def template_variables(self) -> dict[str, Any]:
        given = {} if self.instruction is None else {"instruction": self.instruction}
        return given | (self.chat_template_kwargs or {})  # chat_template_kwargs' instruction wins


class ScoreRequest(ScoringFields):
    """POST /score: `text_1` against `text_2` (or vLLM's `queries` with `documents` or `items`,
    or `data_1` with `data_2`), each a text or a list of texts, paired 1:1, 1:N or N:N."""
    text_1: Texts = Field(description="or queries, or data_1: a text or a list of texts")
    text_2: Texts = Field(description="or documents or items (with queries), or data_2: a text or a list of texts")
    _names: tuple[str, str] = PrivateAttr(SCORE_FIELDS[0])  # the pair of names the body gave, for the errors
    # what an error's `param` may name (router.errors): the body's own names for the two sides
    PARAM_NAMES: ClassVar[frozenset[str]] = frozenset(n for pair in SCORE_FIELDS for n in pair)

    @model_validator(mode="wrap")
    @classmethod
    def _named_pair(cls, data, handler):
        names = SCORE_FIELDS[0]
        if isinstance(data, dict):
            given = [pair for pair in SCORE_FIELDS if pair[0] in data and pair[1] in data]
            named = {name for pair in SCORE_FIELDS for name in pair if name in data}
            if len(given) != 1 or named != set(given[0]):
                raise ValueError("give one pair of inputs: text_1 and text_2, queries and documents, queries and "
                                 "items, or data_1 and data_2")
            names = given[0]
            data = {k: v for k, v in data.items() if k not in names} | {"text_1": data[names[0]],
                                                                        "text_2": data[names[1]]}
        request = handler(data)
        request._names = names
        _paired(len(request.firsts()), len(request.seconds()), names)
        return request

    def firsts(self) -> list[str]:
        return _listed(self.text_1)

    def seconds(self) -> list[str]:
        return _listed(self.text_2)

    def names(self) -> tuple[str, str]:
        """The fields the two sides came in (text_1/text_2, queries/documents, ...)."""
        return self._names


class Document(BaseModel):
    """Jina's and Cohere's document object: its `text` is scored; its other fields (a title, an
    id) come back with it in the results, as Cohere keeps them."""
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(ScoringFields):
    """POST /rerank (Jina's and Cohere's body): `documents` ordered by their score against
    `query`, the best `top_n` of them (0 or less: all). A document is a text, or an object
    with a `text` (Document)."""
    query: str
    documents: str | Document | list[str | Document]  # one document alone, or a list
    top_n: int = 0
    return_documents: bool = True  # Jina's: False leaves each result's document out

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data):  # LangChain's JinaRerank sends "top_n": null
        return nulls_dropped(data, frozenset({"top_n", "return_documents"}))

    @model_validator(mode="after")
    def _pairs_up(self):
        _paired(1, len(self.texts()), ("query", "documents"))
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in _listed(self.documents)]

    def document(self, i: int) -> dict:
        """The i-th document as a result gives it back: {"text": ...}, with an object's other fields."""
        d = _listed(self.documents)[i]
        return {"text": d} if isinstance(d, str) else d.model_dump()


def _paired(num_first: int, num_second: int, names: tuple[str, str]) -> None:
    """score_pairs' check, its error naming the field at fault (router.errors makes it the `param`)."""
    try:
        score_pairs(num_first, num_second)
    except ValueError as e:
        raise ValueError(f"{names[0] if num_first == 0 else names[1]}: {e}") from None


def _listed(texts) -> list:
    return texts if isinstance(texts, list) else [texts]


def score_response(rid: str, model: str, scores: list[float], num_prompt_tokens: int) -> dict:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens, "completion_tokens": 0}}


def rerank_response(rid: str, model: str, req: RerankRequest, scores: list[float], num_prompt_tokens: int) -> dict:
    """The documents best first (ties keep their order), the best top_n of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n > 0:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i]} | ({"document": req.document(i)} if req.return_documents
                                                              else {}) for i in order]
    return {"id": rid, "model": model, "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
            "results": results}
