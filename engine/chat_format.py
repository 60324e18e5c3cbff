"""How a chat template gets a message's content (vLLM's --chat-template-content-format): "string",
its text parts joined by newlines, or "openai", a list of {"type": "text", "text": ...} parts, for
templates that loop over them; "auto" picks "openai" for a template with such a loop. Shared by
the offline `LLM.chat` and the server's chat."""
from __future__ import annotations

import functools
import re

FORMATS = ("auto", "string", "openai")

# a Jinja loop over a message's content: `{% for part in message['content'] %}` (or .content)
_LOOPS_OVER_CONTENT = re.compile(r"""\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['"]content['"]\s*\]|\.content\b)""")


@functools.lru_cache(maxsize=16)  # the server asks once per request, of one template
def resolved(content_format: str, template: str | None) -> str:
    """"string" or "openai": `content_format`, "auto" read from `template` as vLLM detects it."""
    if content_format not in FORMATS:
        raise ValueError(f"chat_template_content_format must be auto, string or openai, got {content_format!r}")
    if content_format != "auto":
        return content_format
    return "openai" if _LOOPS_OVER_CONTENT.search(template or "") else "string"


def as_parts(message: dict) -> dict:
    """A template message whose text content is a list of one text part (the "openai" format)."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message
