"""The engine's live grammar matchers, one per constrained sequence, kept in the engine process.

Each step, before the model runs:   mask(sampling sequences)  -> GrammarMask (or None)
    fills the constrained rows' bitmasks with llguidance's parallel executor; the mask travels
    with the step to wherever the logits are sampled (this process at tp=1, rank 0 at tp > 1).
    (a sequence's drafts, engine.speculative, get the masks of the matcher having taken them)
After the draw, for each sequence:  accept(seq, token)         -> None | "stop" | an error
    the matcher consumes the sampled token: a grammar that is complete ends the sequence, one
    that rejects the token (or fails inside llguidance) ends its request with an error.

A request's forks (n > 1) start from a copy of the parent's matcher, taken before the parent's
first token is consumed: the parent's mask row is theirs too.

A spec with `reasoning_end` holds its grammar back behind a gate (engine.structured.gate) while
the reply reasons: such a sequence has no mask row and feeds no token to its matcher until the
gate opens; while the reply's first token may open the reasoning, its row also allows that token.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.structured.bitmask import GrammarMask
from engine.structured.compiler import CompiledGrammar, GrammarCompiler, short_error
from engine.structured.gate import Gate
from engine.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

STOP = "stop"


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.matchers: dict[int, LLMatcher] = {}  # seq id -> its matcher
        self.gates: dict[int, Gate] = {}  # seq id -> the gate its grammar waits behind
        self._executor: LLExecutor | None = None

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def gate(self, spec: StructuredOutputsParams) -> Gate | None:
        """The gate `spec` asks for (engine.structured.gate); InvalidRequestError for one it cannot
        keep. Asked before the request is taken, so that a refusal leaves nothing behind."""
        return Gate.of(spec, self._single_token)

    def add(self, seq, grammar: CompiledGrammar, gate: Gate | None = None) -> None:
        self.matchers[seq.seq_id] = grammar.matcher()
        if gate is not None:
            self.gates[seq.seq_id] = gate

    def fork(self, parent, child) -> None:
        matcher = self.matchers.get(parent.seq_id)
        if matcher is not None:
            self.matchers[child.seq_id] = matcher.deep_copy()
        gate = self.gates.get(parent.seq_id)
        if gate is not None:
            self.gates[child.seq_id] = dataclasses.replace(gate)

    def drop(self, seq) -> None:
        self.matchers.pop(seq.seq_id, None)
        self.gates.pop(seq.seq_id, None)

    @property
    def words(self) -> int:
        return (self.compiler.ll_tokenizer.vocab_size + 31) // 32

    def mask(self, seqs: list) -> GrammarMask | None:
        """seqs: the step's sampling sequences in row order -> the bitmasks of the constrained ones."""
        if not self.matchers:
            return None
        rows = [(i, m) for i, s in enumerate(seqs) if (m := self.matchers.get(s.seq_id)) is not None
                and not ((gate := self.gates.get(s.seq_id)) and gate.reasoning)]
        if not rows:
            return None
        bits = torch.zeros((len(rows), self.words), dtype=torch.int32)  # (k, W)
        # llguidance.torch's fill_next_token_bitmask(_par), without importing that module (its
        # torch.compile'd kernel costs seconds at import): the same pointer calls.
        row_bytes = bits.shape[1] * 4
        if len(rows) == 1:
            rows[0][1].unsafe_compute_mask_ptr(bits.data_ptr(), row_bytes)
        else:
            self._parallel().unsafe_compute_mask_ptr([(m, j) for j, (_, m) in enumerate(rows)], bits.data_ptr(),
                                                     row_bytes, len(rows))
        words = bits.numpy().view(np.uint32)  # the same memory; uint32, so that bit 31 can be set
        for j, (i, _) in enumerate(rows):
            if (gate := self.gates.get(seqs[i].seq_id)) is not None:  # opening: its token is allowed too
                words[j, gate.opener // 32] |= np.uint32(1 << gate.opener % 32)
        mask_rows = [i for i, _ in rows]
        drafted = self._draft_masks(seqs, mask_rows, row_bytes)
        return GrammarMask(mask_rows, torch.cat([bits, *drafted]) if drafted else bits)

    def _draft_masks(self, seqs: list, mask_rows: list[int], row_bytes: int) -> list[torch.Tensor]:
        """The masks of constrained sequences' draft rows (engine.speculative), which follow the
        sampling sequences' own rows in their order: the row after drafts[:j + 1] gets the mask of
        the matcher having taken them. The rows after a draft the grammar refuses stay unmasked:
        the row before it cannot draw it, so nothing after it is kept. Their rows are appended to
        `mask_rows`; the matchers are rolled back to where they were."""
        out, first = [], len(seqs)
        for seq in seqs:
            drafts = getattr(seq, "spec_token_ids", ())  # (anything with a seq_id samples here)
            matcher = self.matchers.get(seq.seq_id) if drafts else None
            if matcher is not None and not matcher.is_error():
                valid = matcher.validate_tokens(drafts)
                bits = torch.zeros((valid, self.words), dtype=torch.int32)
                for j in range(valid):
                    matcher.consume_token(drafts[j])
                    matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), row_bytes)
                matcher.rollback(valid)
                mask_rows.extend(range(first, first + valid))
                out.append(bits)
            first += len(drafts)
        return out

    def accept(self, seq, token_id: int) -> str | None:
        """Feed `seq` its sampled token. -> None (go on; also for unconstrained sequences), STOP
        (the grammar is complete), or what went wrong."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None or self._through_gate(seq.seq_id, token_id):
            return None
        # A matcher can fail while computing its mask (a lexer over its size limit), leaving a
        # mask of EOS alone; it then still takes that EOS as the grammar's end.
        if matcher.is_error() or not matcher.consume_token(token_id) or matcher.is_error():
            return f"structured output failed: {short_error(matcher.get_error()) or f'token {token_id} is not allowed here'}"
        return STOP if matcher.is_stopped() else None

    def _through_gate(self, seq_id: int, token_id: int) -> bool:
        """Whether `token_id` is the reasoning's (the grammar does not see it)."""
        gate = self.gates.get(seq_id)
        if gate is None:
            return False
        reasoning, opened = gate.step(token_id)
        if opened:
            del self.gates[seq_id]
        return reasoning

    def _single_token(self, text: str) -> int | None:
        """The id of the one token that is `text`, if there is one and the mask can carry it."""
        ids = self.compiler.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] < 32 * self.words else None

    def _parallel(self) -> LLExecutor:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor
