"""A grammar held back while its sequence reasons (a spec with `reasoning_end`).

    opening    the reply's first token is still to come and may open the reasoning: the mask row
               is the grammar's plus that one token (`opener`); drawn, it opens the reasoning,
               any other token shuts the gate and is the grammar's first
    reasoning  no mask row, no token fed to the grammar, until a token's text completes `end`
               (the tag may take several tokens); the grammar takes the token after it

Text after the tag inside the token that completes it is not the grammar's: with thinking models'
vocabularies (`</think>` one token) there is none.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.structured.params import StructuredOutputsParams


@dataclass
class Gate:
    end: str  # the text that ends the reasoning
    opener: int | None = None  # set while opening: the one token that opens the reasoning
    tail: str = ""  # the reasoning's last characters, where `end` is looked for

    @classmethod
    def of(cls, spec: StructuredOutputsParams, single_token: Callable[[str], int | None]) -> Gate | None:
        """The gate `spec` asks for, or None. `single_token(text)`: the id of the one token that
        is `text`, or None; an opening text the model cannot write as one token opens nothing,
        so that spec's grammar applies at once."""
        if not spec.reasoning_end:
            return None
        if spec.reasoning_start is None:
            return cls(spec.reasoning_end)
        opener = single_token(spec.reasoning_start)
        return None if opener is None else cls(spec.reasoning_end, opener)

    @property
    def reasoning(self) -> bool:
        """Whether the sequence is inside its reasoning (no grammar row at all)."""
        return self.opener is None

    def step(self, token_id: int, text: Callable[[int], str]) -> tuple[bool, bool]:
        """The sampled `token_id` (`text(id)`: its text) -> (whether it is the reasoning's, not
        the grammar's; whether the gate is now open for good)."""
        if self.opener is not None:  # the reply's first token: it opens the reasoning, or the answer begins
            if token_id != self.opener:
                return False, True
            self.opener = None
            return True, False
        self.tail = (self.tail + text(token_id))[-4 * len(self.end):]
        return True, self.end in self.tail
