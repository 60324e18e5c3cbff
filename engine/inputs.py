"""vLLM's prompt dicts (vllm.inputs), for scripts that build their prompts with them: `LLM.generate`
takes plain dicts of the same keys as well."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only between prompts of one salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
