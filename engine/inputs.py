"""vLLM's prompt dicts (vllm.inputs), for scripts that build their prompts with them: `LLM.generate`
takes plain dicts of the same keys as well; `unwrapped_prompt` reads any of them."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only between prompts of one salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def unwrapped_prompt(prompt: PromptType) -> tuple[str | list[int], str | None]:
    """A prompt as the engine takes it (text or token ids), and a dict's cache_salt."""
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
            raise ValueError("multi-modal prompts are not supported: the engine serves text models")
        keys = {k for k, v in prompt.items() if v is not None} - {"multi_modal_data", "mm_processor_kwargs",
                                                                    "cache_salt"}
        if keys == {"prompt_token_ids"}:
            return unwrapped_prompt(list(prompt["prompt_token_ids"]))[0], prompt.get("cache_salt")
        if keys == {"prompt"}:
            return unwrapped_prompt(prompt["prompt"])[0], prompt.get("cache_salt")
        raise ValueError(f"a prompt dict holds `prompt` (text) or `prompt_token_ids`, got {sorted(prompt)}")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt, None
    raise TypeError(f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}")
