"""Per-request sampling parameters (vLLM names and defaults), validated on construction."""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
import warnings
from dataclasses import dataclass

from engine.errors import InvalidRequestError, brief
from engine.lora_request import LoRARequest
from engine.structured.params import StructuredOutputsParams

DEFAULT_MAX_LOGPROBS = 20  # logprobs a request may ask per token unless the engine allows more (vLLM's)
MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias
MAX_BIAS = 1e30  # a bias's size: float32 logits stay finite after temperature and penalties
MAX_BAD_WORDS = 100  # entries in one request's bad_words (each is checked per step)
MAX_BAD_WORD_CHARS = 1000  # a bad word's length (each is tokenized on the engine's step thread)
MAX_STOP_STRINGS = 128  # entries in one request's stop (each is searched for after every token)
SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # a temperature above 0 but below it samples at it (vLLM's _MAX_TEMP): no inf / nan
MAX_TEMPERATURE = 1e6  # and one above it at it: a near-uniform draw whichever, and finite in float32
GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10.2 (SamplingParams(guided_decoding=...))


class RequestOutputKind(enum.IntEnum):
    """Which outputs the engine hands out for a request (vLLM's names and values)."""
    CUMULATIVE = 0  # as DELTA here: every output has the text and token ids so far (and the deltas)
    DELTA = 1  # as tokens come (every stream_interval tokens): deltas, and the text so far
    FINAL_ONLY = 2  # the first (its time to first token) and the finished one: no per-token work


_INT_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_OPTIONAL = {"max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 (or < SAMPLING_EPS) => greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 disables
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # per-request generator, reproducible regardless of batching
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    max_tokens: int | None = 16  # None = up to max_model_len (resolved by the engine)
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens exist
    ignore_eos: bool = False  # keep generating past eos
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a schema / grammar
    logprobs: int | None = None  # top logprobs per token; 0 = only the sampled token's; -1 = the whole vocabulary
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # False: a slow tokenizer's decode joins them (fast ones have no such option)
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only, no text (nor stop strings)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (from the prefill); 0 = only its own; -1 = all
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words the output may not complete (engine.token_bans)
    bad_words_token_ids: list[list[int]] | None = None  # bad_words as token ids: the engine fills it
    output_kind: RequestOutputKind = RequestOutputKind.DELTA  # FINAL_ONLY: a caller that does not stream
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt
    # Under scheduling_policy "priority": lower runs first (vLLM's); must be 0 under "fcfs".
    priority: int = 0
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: what leaves room for max_tokens
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's name before 0.10.2: becomes structured_outputs
    extra_args: dict | None = None  # vLLM's, for plugins' sampling: kept, read by nothing here (as in vLLM)
    # The LoRA adapter the request runs with (engine.lora_request; None: the base model). vLLM passes
    # it beside the params; here `LLM.generate(lora_request=...)` and the server's model name set it.
    lora_request: LoRARequest | None = None
    # A pooling request's (engine.pooling.PoolingParams.sampling sets it; LLM.embed, /v1/embeddings):
    # the request draws its prompt's vector instead of tokens.
    pooling: object = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("guided_decoding", "guided_decoding and structured_outputs are one "
                                                             "setting (the older name and the newer): give one")
            warnings.warn("SamplingParams(guided_decoding=...) is vLLM's name before 0.10.2; "
                          "use structured_outputs=StructuredOutputsParams(...)", DeprecationWarning, stacklevel=3)
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError("stop", f"stop must be a string or a list of strings, got {brief(self.stop)}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of token ids, "
                                                        f"got {brief(self.stop_token_ids)}")
        self.stop_token_ids = [] if self.stop_token_ids is None else _unique(self.stop_token_ids)
        # token ids as JSON keys them ("28") are ids, as vLLM takes them
        self.logit_bias = {int(t) if isinstance(t, str) and t.isdigit() else t: b
                           for t, b in self.logit_bias.items()} if self.logit_bias else None
        self.allowed_token_ids = None if self.allowed_token_ids is None else _unique(self.allowed_token_ids)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: True is 1 (False 0)
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if self.seed == -1:  # vLLM's: -1 asks for no seed
            self.seed = None
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE or self.temperature > MAX_TEMPERATURE:
            self.temperature = min(max(self.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
        if self.temperature < SAMPLING_EPS:  # greedy: the filters choose nothing, and read as vLLM's say so
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's: these params, a field given as None taking its default (max_tokens None is no
        limit but the model's room, as vLLM's); logit_bias keys read as ints, biases within +-100."""
        if kwargs.get("logit_bias") is not None:
            kwargs["logit_bias"] = {int(t): min(100.0, max(-100.0, b)) for t, b in kwargs["logit_bias"].items()}
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's)."""
        return copy.deepcopy(self)

    def _validate(self) -> None:
        def need(cond: bool, field: str, rule: str) -> None:
            if not cond:
                raise InvalidRequestError(field, f"{field} must be {rule}, got {brief(getattr(self, field))}")

        for field in _INT_FIELDS:
            value = getattr(self, field)
            need(value is None and field in _OPTIONAL or isinstance(value, numbers.Integral) and not isinstance(value, bool),
                 field, "an int" + (" or None" if field in _OPTIONAL else ""))
        for field in _FLOAT_FIELDS:
            value = getattr(self, field)
            need(isinstance(value, numbers.Real) and not isinstance(value, bool), field, "a number")
        need(self.n >= 1, "n", ">= 1")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "a StructuredOutputsParams")
        need(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "a dict or None")
        need(0 <= self.temperature < math.inf, "temperature", ">= 0 and finite")
        need(self.seed is None or -(1 << 63) <= self.seed <= (1 << 63) - self.n, "seed",
             "in [-2^63, 2^63 - n] (a 64-bit seed; sample i takes seed + i)")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(self.top_k >= -1, "top_k", ">= 1, or 0 / -1 to disable")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(0 < self.repetition_penalty < math.inf, "repetition_penalty", "> 0 and finite")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1 or None")
        need(self.min_tokens >= 0, "min_tokens", ">= 0")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens", f"<= max_tokens ({self.max_tokens})")
        need(self.logprobs is None or self.logprobs >= -1, "logprobs", ">= 0, -1 (the whole vocabulary) or None")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        need(self.detokenize or not self.stop, "stop", "empty with detokenize=False (stop strings are matched on text)")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids")
        need(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
             ">= 0, -1 (the whole vocabulary) or None")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, "
                                      f"got {len(bias)}")
        need(all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias", "keyed by non-negative token ids")
        # Applied as given, as vLLM's offline params take it (the server clamps to OpenAI's [-100, 100]);
        # finite, so that a row the request bans whole is uniform rather than NaN
        need(all(isinstance(b, numbers.Real) and abs(b) <= MAX_BIAS for b in bias.values()), "logit_bias",
             f"finite biases (at most {MAX_BIAS:g} either way; to ban a token, use a large negative one or bad_words)")
        need(self.allowed_token_ids is None or (self.allowed_token_ids and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
             "a non-empty list of token ids")
        need(len(self.bad_words or ()) <= MAX_BAD_WORDS, "bad_words", f"at most {MAX_BAD_WORDS} words")
        need(all(len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words or () if isinstance(w, str)), "bad_words",
             f"words of at most {MAX_BAD_WORD_CHARS} characters")
        need(all(isinstance(w, str) and w.strip() for w in self.bad_words or ()), "bad_words", "non-blank strings")
        need(isinstance(self.priority, int) and not isinstance(self.priority, bool), "priority", "an integer")
        need(self.lora_request is None or isinstance(self.lora_request, LoRARequest), "lora_request",
             "a LoRARequest or None")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt), "cache_salt",
             "a non-empty string or None")
        need(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1,
             "truncate_prompt_tokens", ">= 1, or -1 (as many as leave room for max_tokens)")

    def check_token_ids(self, vocab: int) -> None:
        """InvalidRequestError naming the field that holds a token id the model lacks (>= vocab;
        negative ids are refused at construction)."""
        for field, ids, what in (("stop_token_ids", self.stop_token_ids, "stop_token_ids"),
                                 ("logit_bias", self.logit_bias or (), "logit_bias token ids"),
                                 ("allowed_token_ids", self.allowed_token_ids or (), "allowed_token_ids")):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(field, f"{what} must be in [0, {vocab})")

    def within_logprobs_cap(self, max_logprobs: int, vocab: int, names: dict[str, str] | None = None) -> SamplingParams:
        """These params with -1 (the whole vocabulary) resolved to `vocab`; InvalidRequestError,
        in vLLM's words, when they ask more logprobs per token than `max_logprobs` (the engine's
        --max-logprobs; -1: no cap). `names`: the request's names of the fields, where others."""
        cap = vocab if max_logprobs == -1 else max_logprobs
        resolved = {}
        for field, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = vocab if getattr(self, field) == -1 else getattr(self, field)
            if asked is not None and asked > cap:
                name = (names or {}).get(field, field)
                raise InvalidRequestError(name, f"Requested {what} logprobs of {asked} ({name}), which is greater "
                                                f"than max allowed: {cap} (the engine's max_logprobs, --max-logprobs)")
            if asked != getattr(self, field):
                resolved[field] = asked
        return dataclasses.replace(self, **resolved) if resolved else self

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (one in (0, MIN_TEMPERATURE) samples at MIN_TEMPERATURE, as vLLM's
        does), or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def split(self, max_num_seqs: int) -> list[tuple[int, SamplingParams]]:
        """The engine calls that give these params' n samples: (the first sample's index, params).
        The engine forks one call's samples together after the prompt's prefill, so they must fit
        in its max_num_seqs at once; a larger n is cut into calls of at most that many (about
        equal), each seeded where its samples sit in one call (sample i takes seed + i), so the
        samples are those one call would give; the prompt's blocks are shared by prefix caching."""
        parts = -(-self.n // max_num_seqs)
        if parts == 1:
            return [(0, self)]
        sizes = [self.n // parts + (k < self.n % parts) for k in range(parts)]
        firsts = [sum(sizes[:k]) for k in range(parts)]
        return [(first, dataclasses.replace(self, n=size, seed=None if self.seed is None else self.seed + first))
                for first, size in zip(firsts, sizes)]


def framing_tokens(tokenizer, pooler=None) -> tuple[int, int] | None:
    """An encoder tokenizer's opening and closing special tokens ([CLS] and [SEP], <s> and </s>):
    `truncated`'s `ends`; None where it has not both, or where `pooler` (engine.pooling's
    PoolerConfig, None: a generating engine) is not an encoder's."""
    if pooler is None or not pooler.encoder:
        return None
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    return None if cls is None or sep is None else (cls, sep)


def check_truncation(keep: int, max_model_len: int) -> None:
    """InvalidRequestError for a truncate_prompt_tokens no prompt can keep."""
    if keep == 0:  # as the offline params refuse it (it would keep nothing, or on the left side all)
        raise InvalidRequestError("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1, or -1, got 0")
    if keep > max_model_len:  # vLLM's rule
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens value ({keep}) is greater than "
                                  f"max_model_len ({max_model_len}). Please request a smaller truncation size.")


def truncated(prompt_token_ids: list[int], keep: int, max_model_len: int, max_tokens: int | None = None,
              side: str | None = None, max_param: str = "max_tokens",
              asked: str = "truncate_prompt_tokens -1", ends: tuple[int, int] | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (its first, `side` "right");
    -1: as many as leave room for `max_tokens` (all of max_model_len without one, as vLLM's, which
    leaves a prompt that long no room: refused here naming `max_param`, the field to give, and
    `asked`, what the request said). `ends`: an encoder's opening and closing special tokens
    ([CLS], [SEP]); a prompt framed by them keeps them, and the tokens between are cut, as the
    tokenizer's own truncation of the text gives it."""
    check_truncation(keep, max_model_len)
    if keep == -1:
        keep = max_model_len - (max_tokens or 0)
        if keep < 1:
            raise InvalidRequestError(max_param, f"{max_param} ({max_tokens}) leaves no room in max_model_len "
                                      f"({max_model_len}) for the prompt that {asked} keeps")
        if max_tokens is None and len(prompt_token_ids) >= max_model_len:
            raise InvalidRequestError(max_param, f"the prompt has {len(prompt_token_ids)} tokens; "
                                      f"{asked} without {max_param} keeps max_model_len "
                                      f"({max_model_len}) of them, which leaves no room for a reply: give {max_param}",
                                      code="context_length_exceeded")
    if keep >= len(prompt_token_ids):
        return prompt_token_ids
    ids = prompt_token_ids
    if ends is not None and ids[0] == ends[0] and ids[-1] == ends[1]:
        if keep < 2:
            raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens ({keep}) must keep at least "
                                      "2 tokens of an encoder's prompt: its opening and closing special tokens")
        inner = ids[1:-1]
        inner = inner[:keep - 2] if side == "right" else inner[len(inner) - (keep - 2):]
        return [ids[0], *inner, ids[-1]]
    return ids[:keep] if side == "right" else ids[-keep:]


def _unique(ids) -> list:
    """`ids` as a list, each once, in order (a list of a vocabulary's ids is then no longer than it);
    as given when not hashable, for the validation to name."""
    try:
        return list(dict.fromkeys(ids))
    except TypeError:
        return list(ids)


def priority_refusal(priority: int) -> str:
    """Why a request's priority is refused by an engine scheduling first come, first served (vLLM's words)."""
    return f"Got priority {priority} but priority scheduling is not enabled (--scheduling-policy priority)"
