"""Grammars for constrained decoding, compiled off the step thread and cached by spec.

    StructuredOutputsParams --to_grammar--> llguidance grammar text       (cheap, no tokenizer)
                            --GrammarCompiler.submit--> Future[CompiledGrammar]
                                 on a worker thread: builds the lexer against the tokenizer
                                 (LLMatcher; up to ~1 s for a huge grammar, GIL released)
    CompiledGrammar.matcher()  a fresh matcher per sequence (a deep copy: microseconds)

llguidance itself is imported on the first grammar, and its tokenizer (~1 s to build) made on the
first constrained request, so engines that never see one never pay for it (nor need it
installed). A compile that fails is cached too, so a bad schema sent again is refused at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams
from engine.structured.regex import ascii_classes
from engine.structured.schemas import closed_objects, enforceable

if TYPE_CHECKING:
    import llguidance
    from llguidance import LLMatcher

# JSON laid out as the model writes it, compact or pretty: at each place JSON allows whitespace,
# none, one space, or a newline and an indent, never a run of it (a model allowed any whitespace
# can fill max_tokens with newlines). vLLM's default (xgrammar's any whitespace) lets the model
# choose too: `{"a":1}` and `{\n    "a": 1\n}` come out as from vLLM. disable_any_whitespace:
# none at all. A schema's own x-guidance wins.
JSON_WHITESPACE = r"(?:[ ]?|\n[ ]{0,32})"
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
                 "whitespace_pattern": JSON_WHITESPACE}
PARAM = "structured_outputs"
_RANGE = re.compile(r"Failed to generate regex for (integer|float) range: min=(Some\([^)]*\)|None), "
                    r"max=(Some\([^)]*\)|None)")


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`; InvalidRequestError when its text is not even parseable."""
    import llguidance
    from llguidance import LLMatcher

    try:
        if params.json is not None or params.json_object:  # json_object: any object, keys and all
            schema = _closed_json(params.json) if params.json is not None else '{"type": "object"}'
            # a whitespace_pattern is all the whitespace between JSON tokens, around bare separators
            defaults = dict(JSON_DEFAULTS)
            if params.whitespace_pattern is not None:
                defaults["whitespace_pattern"] = params.whitespace_pattern
            elif params.disable_any_whitespace:
                del defaults["whitespace_pattern"]
            return LLMatcher.grammar_from_json_schema(schema, defaults=defaults,
                                                      overrides={"lenient": True} if params.lenient else None)
        if params.regex is not None:
            return LLMatcher.grammar_from_regex(ascii_classes(params.regex))
        if params.choice is not None:
            return llguidance.grammar_from("choice", list(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise InvalidRequestError(PARAM, f"the {params.kind} is invalid: {e}") from None


def _closed_json(text: str) -> str:
    """closed_objects of a schema's JSON text, enforceable (text llguidance will refuse is passed
    on as it is); ValueError for a schema it would not hold the output to."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    try:
        return json.dumps(closed_objects(enforceable(schema)))
    except RecursionError:  # a schema sent as a string is not held to the body's depth limit
        raise ValueError("the schema nests too deeply") from None


def check(params: StructuredOutputsParams) -> str | None:
    """Why llguidance cannot compile `params` (unsupported schema keywords, bad regex or grammar
    syntax), or None; without a tokenizer, so cheap enough for the HTTP edge."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(to_grammar(params))
    except InvalidRequestError as e:
        return e.message
    return said(error) if error else None


@dataclass(frozen=True)
class CompiledGrammar:
    prototype: LLMatcher | None  # never advanced; each sequence gets a copy
    error: str | None = None

    def matcher(self) -> LLMatcher:
        return self.prototype.deep_copy()


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], max_workers: int = 1,
                 cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width; the mask covers max(this, tokenizer)
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._max_workers = max_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()  # held while the llguidance tokenizer is built
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                from llguidance.hf import from_tokenizer

                n_vocab = self.vocab_size if self.vocab_size > len(self.tokenizer) else None
                self._ll_tokenizer = from_tokenizer(self.tokenizer, n_vocab=n_vocab,
                                                    eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """-> Future[CompiledGrammar], shared by every request with the same spec."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._max_workers,
                                                                   thread_name_prefix="kvserve-grammar")
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return checked(self.submit(params).result())

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return checked(await asyncio.wrap_future(self.submit(params)))

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        try:
            grammar = to_grammar(params)
        except InvalidRequestError as e:
            return CompiledGrammar(None, e.message)
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return CompiledGrammar(None, f"the {params.kind} cannot be compiled: {said(short_error(matcher.get_error()))}")
        probe = matcher.deep_copy()  # its first mask: a language with no text fails here, not at the first step
        probe.compute_logit_bias()
        if probe.is_error():
            return CompiledGrammar(None, f"the {params.kind} matches no text: no token can begin its output")
        return CompiledGrammar(matcher)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def short_error(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends (for logs, not clients)."""
    return error.split("\n<state>", 1)[0].strip()


def said(error: str) -> str:
    """llguidance's refusal in words a client can act on."""
    match = _RANGE.search(error)
    if match is None:
        return error
    kind, low, high = match.groups()
    kind = "number" if kind == "float" else kind
    bounds = ", ".join(f"{name} {_bound(v)}" for name, v in (("minimum", low), ("maximum", high)) if v != "None")
    return (f"the {kind} range ({bounds}) cannot be enforced: constrained decoding holds integers within "
            "64 bits and numbers within about 1e17")


def _bound(value: str) -> str:
    return value.removeprefix("Some(").removesuffix(")")


def checked(grammar: CompiledGrammar) -> CompiledGrammar:
    if grammar.error is not None:
        raise InvalidRequestError(PARAM, grammar.error)
    return grammar
