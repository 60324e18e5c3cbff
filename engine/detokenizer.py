"""Incremental detokenization with stop strings, for streaming text deltas.

Token ids are decoded over a small sliding window (the prefix_offset/read_offset technique):

    ids:  ... | prefix_offset ......... read_offset ......... end |
                 already-emitted context  |  not yet emitted text

prefix_text = decode(ids[prefix:read]) and new_text = decode(ids[prefix:]); the new characters are
new_text[len(prefix_text):]. They are taken only once new_text does not end in U+FFFD, i.e. once
every multi-byte UTF-8 character split across byte-level tokens is complete. Decoding with a few
tokens of left context keeps tokenizers that treat the first token specially (leading spaces)
consistent with a decode of the whole sequence.

Byte-fallback tokenizers (Llama 2, Mistral, Gemma: `<0x00>`..`<0xFF>` tokens) decode a run of byte
tokens together, one U+FFFD per byte when the run is not valid UTF-8, so a run's text can change
with its next byte (a "\u2713" read, then `<0x80>`: the window decodes as four U+FFFD, not "\u2713"
and one). Where a window's text no longer starts with the text already read, the window restarts
at the first unread token (vLLM's DecodeStream does the same on its "invalid prefix"): the text
read stands, the stray byte is one U+FFFD. A read that would decode byte tokens in one window
replays them one at a time, so the text is the same however often it is read.

Without stop strings nothing needs the text until it is read (a streamed delta, the final output),
so tokens are decoded then, all at once: an offline request decodes twice in all instead of twice
per token. A read that lands inside a character replays its tokens one at a time, so every read
returns exactly what per-token decoding would have.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

from engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tail used as left context for the first output tokens
REPLACEMENT_CHAR = "\ufffd"


def decoder(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or the same call one layer down: a transformers fast tokenizer that
    neither overrides decoding nor cleans up spaces only converts its arguments and calls its Rust
    tokenizer's decode, so that is called directly (same string, ~0.8 us a call instead of ~3 here;
    the detokenizer decodes twice per generated token)."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return tokenizer.decode
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    if (isinstance(backend, Tokenizer) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode):
        return backend.decode
    return tokenizer.decode


_BYTE_TOKENS: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def byte_token_ids(tokenizer) -> frozenset[int]:
    """The ids of a byte-fallback vocabulary's `<0x00>`..`<0xFF>` tokens; empty for any other (a
    byte-level BPE such as SmolLM2's or Llama 3's). Looked up once per tokenizer."""
    try:
        return _BYTE_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = frozenset()
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        found = convert([f"<0x{b:02X}>" for b in range(256)])
        unk = getattr(tokenizer, "unk_token_id", None)
        if None not in found and unk not in found and len(set(found)) == 256:
            ids = frozenset(found)
    try:
        _BYTE_TOKENS[tokenizer] = ids
    except TypeError:  # not weakly referenceable: looked up again next time
        pass
    return ids


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 decode: Callable[..., str] | None = None) -> None:
        """decode: `decoder(tokenizer)`, when the caller keeps one for many requests."""
        self.tokenizer = tokenizer
        self._decode_ids = decode or decoder(tokenizer)
        self._decode_kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:  # an option of slow tokenizers' decode only
            self._decode_ids = tokenizer.decode
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self.params = params
        self._text = ""  # committed text, truncated at a matched stop string
        self.stop_string: str | None = None  # the stop string that ended the output, if any
        self.num_output_tokens = 0
        self._byte_ids = byte_token_ids(tokenizer)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(self._ids).endswith(REPLACEMENT_CHAR):
            self._ids = []  # a prompt cut inside a character would misalign the window
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted = 0  # chars of output_text already returned by get_delta
        # A stop string split across tokens is at most this many chars long before it completes.
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._lazy = not params.stop  # decode when read: no stop string waits on each token's text
        self._unread = 0  # tokens appended but not yet decoded (lazy only)
        self._off = not params.detokenize  # token ids only: never decoded, the text stays ""

    @property
    def output_text(self) -> str:
        if self._unread and not self._off:
            self._catch_up()
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends the text of new tokens; returns the stop string that matched, if one did."""
        if self.stop_string is not None:
            return None
        self._ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        if self._lazy:
            self._unread += len(new_token_ids)
            return None
        return self._append(self._decode_new(flush=False))

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned. While unfinished, the tail that could start a stop string is held."""
        if self._off:
            return ""
        if self._unread:
            self._catch_up()
        if finished and self.stop_string is None and self._read_offset < len(self._ids):
            # incomplete trailing bytes, as decode() shows them (vLLM never shows them at all); the
            # sequence has ended already, so a stop string found in them cuts the text (which never
            # holds one) without being the reason it ended
            self._append(self._decode_new(flush=True), ended=True)
        final = finished or self.stop_string is not None
        end = len(self._text) if final else len(self._text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _catch_up(self) -> None:
        """Decodes the unread tokens in one window when that text ends on a whole character (token by
        token extends the same window to the same text), else token by token."""
        unread, self._unread = self._unread, 0  # callers ask only when there is one
        if unread > 1 and self._byte_ids and not self._byte_ids.isdisjoint(self._ids[-unread:]):
            text = ""  # a run of byte tokens reads as each token's read would have left it
        else:
            text = self._decode_new(flush=False)
        if text or unread == 1:
            self._append(text)
            return
        tokens = self._ids[-unread:]
        del self._ids[-unread:]
        for token in tokens:
            self._ids.append(token)
            self._append(self._decode_new(flush=False))

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, **self._decode_kwargs)

    def _decode_new(self, flush: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if self._byte_ids and not new_text.startswith(prefix_text):  # a byte run went on past the text read
            self._prefix_offset, prefix_text = self._read_offset, ""
            new_text = self._decode(self._ids[self._read_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not flush):
            return ""  # nothing printable yet
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _append(self, text: str, ended: bool = False) -> str | None:
        if not text:
            return None
        old_len = len(self._text)
        self._text += text
        if self.num_output_tokens <= self.params.min_tokens:  # vLLM's: a stop string ends after the first min_tokens
            return None
        match = self._find_stop(old_len)
        if match is None:
            return None
        stop, start = match
        end = start + len(stop) if self.params.include_stop_str_in_output else start
        self._text = self._text[:end]
        if ended:
            return None
        self.stop_string = stop
        return stop

    def _find_stop(self, old_len: int) -> tuple[str, int] | None:
        """The first stop string, in the request's order, that ends in the text appended after
        old_len (vLLM's rule: a token whose text completes two stops ends at the one listed first,
        wherever the other starts). The engine appends one token at a time."""
        for stop in self.params.stop:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1:
                return stop, start
        return None
