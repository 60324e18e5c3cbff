"""A grammar held back while its sequence reasons (a spec with `reasoning_end`).

    opening    the reply's first token is still to come and may open the reasoning: the mask row
               is the grammar's plus that one token (`opener`); drawn, it opens the reasoning,
               any other token shuts the gate and is the grammar's first
    reasoning  no mask row, no token fed to the grammar, until the token that ends the reasoning
               is drawn; the grammar takes the token after it

Both tags must each be one token of the vocabulary, as thinking models' are (Qwen3's `<think>` and
`</think>`, R1's): a tag written in pieces could end inside a token that also carries the answer's
first characters, which no grammar would then see. An end tag that is not one token is refused;
an opening tag that is not one cannot be drawn, so the reply begins with its answer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams


@dataclass
class Gate:
    end: int  # the token that ends the reasoning
    opener: int | None = None  # set while opening: the one token that opens the reasoning

    @classmethod
    def of(cls, spec: StructuredOutputsParams, single_token: Callable[[str], int | None]) -> Gate | None:
        """The gate `spec` asks for, or None (its grammar applies at once). `single_token(text)`:
        the id of the one token that is `text`, or None."""
        if not spec.reasoning_end:
            return None
        end = single_token(spec.reasoning_end)
        if end is None:
            raise InvalidRequestError("structured_outputs", f"reasoning_end {spec.reasoning_end!r} is not one token "
                                      "of this model's vocabulary")
        if spec.reasoning_start is None:
            return cls(end)
        opener = single_token(spec.reasoning_start)
        return None if opener is None else cls(end, opener)

    @property
    def reasoning(self) -> bool:
        """Whether the sequence is inside its reasoning (no grammar row at all)."""
        return self.opener is None

    def step(self, token_id: int) -> tuple[bool, bool]:
        """The sampled `token_id` -> (whether it is the reasoning's, not the grammar's; whether the
        gate is now open for good)."""
        if self.opener is not None:  # the reply's first token: it opens the reasoning, or the answer begins
            if token_id != self.opener:
                return False, True
            self.opener = None
            return True, False
        return True, token_id == self.end
