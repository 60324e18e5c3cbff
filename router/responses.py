"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a request becomes a chat
request (instructions as the system message, then the input messages), runs as one, and its one
choice comes back as a response object, or as the Responses stream's typed events.

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed (or .incomplete)

Nothing is stored (`store` comes back false, as vLLM answers without its store), so a request
that needs a stored response or conversation is a 400, as are fields for features this server
lacks (tools, reasoning, background runs), rather than a reply that looks fine without them.
"""
from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from router.errors import from_validation_error
from router.formatting import Accumulator
from router.protocol import ChatCompletionRequest, _Model, _schema_size_ok


class InputText(_Model):
    type: Literal["input_text", "output_text"]  # a user's text, or an earlier reply's
    text: str


class InputMessage(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def to_chat(self) -> dict:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class TextFormat(_Model):
    """`text.format`: Responses' form of chat's response_format, with json_schema's fields inline."""
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _size(self):
        _schema_size_ok(self.schema_, "text.format.schema")
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None  # the system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    store: bool = True  # OpenAI's default; nothing is stored here, and the reply says store: false
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] | None = None
    # Defined by OpenAI, not implemented here: a 400 when set.
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"

    @model_validator(mode="after")
    def _check_unsupported(self):
        for name, why in (("tools", "use /v1/chat/completions for tool calling"),
                          ("previous_response_id", "this server stores no responses"),
                          ("conversation", "this server stores no conversations"),
                          ("prompt", "this server stores no prompt templates"),
                          ("include", "no extra output is available"),
                          ("background", "responses run in the foreground only"),
                          ("top_logprobs", "use /v1/chat/completions for logprobs")):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported in /v1/responses: {why}")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported in /v1/responses: it has no tools")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise ValueError("reasoning is not supported in /v1/responses: the served model does not reason")
        if self.truncation == "auto":
            raise ValueError("truncation auto is not supported: a prompt over the context length is a 400")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The same request on the chat path (400 for what the chat path refuses)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [m.to_chat() for m in self.input]
        body = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None


class ResponseReply:
    """One request's response object and stream events: one message output item whose one
    output_text part holds the reply."""

    def __init__(self, req: ResponsesRequest, model: str, created: int) -> None:
        self.req, self.model, self.created = req, model, created
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self._seq = itertools.count()

    def whole(self, acc: Accumulator) -> dict:
        text, finish = self._result(acc)
        return self._response(self._status(finish), [self._item(text, self._status(finish))], acc, finish)

    def _result(self, acc: Accumulator) -> tuple[str, str | None]:
        (choice,) = acc.choices
        return "".join(choice.text), choice.finish_reason

    @staticmethod
    def _status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def _item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, status: str, output: list[dict], acc: Accumulator | None = None,
                  finish: str | None = None) -> dict:
        r = self.req
        text_format = r.text.format.model_dump(by_alias=True, exclude_none=True) \
            if r.text is not None and r.text.format is not None else {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
               "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": output, "parallel_tool_calls": r.parallel_tool_calls,
               "temperature": 1.0 if r.temperature is None else r.temperature,
               "top_p": 1.0 if r.top_p is None else r.top_p, "tool_choice": r.tool_choice or "auto", "tools": [],
               "text": {"format": text_format}, "truncation": r.truncation, "store": False,
               "metadata": r.metadata or {}, "user": r.user, "usage": None}
        if acc is not None:
            u = acc.usage()
            out["usage"] = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                            "output_tokens": u["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}
        return out

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def error_event(self, body: dict) -> str:
        """An error while streaming: Responses' `error` event (OpenAI error JSON's fields)."""
        e = body["error"]
        return self.event("error", code=e.get("code"), message=e["message"], param=e.get("param"))

    async def events(self, steps: AsyncIterator[tuple[int, object]], acc: Accumulator) -> AsyncIterator[str]:
        """The stream: `steps` are the chat path's outputs (an error ends them as one string)."""
        yield self.event("response.created", response=self._response("in_progress", []))
        yield self.event("response.in_progress", response=self._response("in_progress", []))
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.output_item.added", output_index=0, item=self._item(None, "in_progress"))
        yield self.event("response.content_part.added", **where, part=self._part(""))
        async for _, step in steps:
            if isinstance(step, str):  # the error event: nothing follows it
                yield step
                return
            for c in step.choices:
                if c.text:
                    yield self.event("response.output_text.delta", **where, delta=c.text, logprobs=[])
        text, finish = self._result(acc)
        status = self._status(finish)
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self._part(text))
        item = self._item(text, status)
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event(f"response.{status}", response=self._response(status, [item], acc, finish))
