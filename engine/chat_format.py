"""How a chat template gets a message's content (vLLM's --chat-template-content-format): "string",
its text parts joined by newlines, or "openai", a list of {"type": "text", "text": ...} parts, for
templates that loop over them; "auto" picks "openai" for a template with such a loop. And the
`developer` role (newer OpenAI clients send it for `system`) for templates that do not know it.
Shared by the offline `LLM.chat` and the server's chat."""
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


def developer_as_system(messages: list[dict], template: str | None) -> list[dict]:
    """vLLM's reading of OpenAI's `developer` role for a template that never names it: each such
    message is a system one, and the system messages are then one, first (templates that render a
    default system prompt, or want theirs first, see one). Otherwise the messages as given."""
    if not any(m.get("role") == "developer" for m in messages) or re.search(r"""["']developer["']""", template or ""):
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [m for m in converted if m.get("role") == "system"]
    if len(systems) == 1 and converted[0] is systems[0]:
        return converted
    text = "\n\n".join(t for t in (_text(m.get("content")) for m in systems) if t)
    return [{"role": "system", "content": text}, *(m for m in converted if m.get("role") != "system")]


def _text(content) -> str:
    if isinstance(content, list):  # text parts (a part may be a bare string)
        return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content
                         if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
    return content or ""


def as_parts(message: dict) -> dict:
    """A template message whose text content is a list of one text part (the "openai" format)."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message
