"""OpenAI's Responses API (router.responses), its reply side: one chat choice as a response object,
or as the Responses stream's typed events.

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed (or .incomplete)

With a reasoning parser (router.reasoning) the reply's reasoning comes first, as a `reasoning`
item with one `reasoning_text` part (response.reasoning_text.delta events). A call in the reply
(chat's tool plan parses it out, router.tools) becomes a `function_call` output item, streamed
as response.function_call_arguments.delta events. With `include:
["message.output_text.logprobs"]` the message's output_text part gets the logprobs of the
output's tokens after its reasoning, and each text delta those of its own tokens. A background
run's record goes through queued, in_progress and its end here too (router.background).
"""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from router.formatting import Accumulator
from router.reasoning import ReasoningStream
from router.responses import FunctionChoice, ResponsesRequest, new_id
from router.tool_parser import CLOSE
from router.tools import ToolPlan


class ResponseReply:
    """One request's response object and stream events. Its output items, in the order they
    form: a reasoning item (one reasoning_text part) when a reasoning parser found reasoning, the
    message (one output_text part) when the reply has text, and a function_call item per call
    the reply made (chat's tool plan parses them out of the text)."""

    def __init__(self, req: ResponsesRequest, model: str, created: int, plan: ToolPlan,
                 store: Callable[[dict], Awaitable[bool]] | None = None, thinking: bool | None = None,
                 reasoning_tokens: Callable[[list[int]], int] | None = None,
                 logprobs: Callable[[list[int], list[dict[int, float]]], list[dict]] | None = None) -> None:
        """`store(response)`: keeps the finished response (before a stream's last event goes out,
        so a follow-up sent on that event finds it; a background one's record at every change of
        its status) and says whether it did. `thinking`: as the
        chat path's (router.reasoning): None, the reply is not split; else whether it opens
        inside its reasoning. `reasoning_tokens(output token ids)`: how many are reasoning.
        `logprobs(token ids, their logprob entries)`: their items in the message's output_text
        (include message.output_text.logprobs), which gets those of the output's tokens after its
        reasoning (as chat's content logprobs, a tool call's tokens too); each text delta those
        of the tokens since the one before."""
        self.req, self.model, self.created, self.plan, self.thinking = req, model, created, plan, thinking
        self.reasoning_tokens, self.logprobs = reasoning_tokens, logprobs
        self.id = req.request_id or new_id("resp")  # vLLM's request_id names it as given
        self._seq = itertools.count()
        self._store = store
        self._error: dict | None = None

    # -- a whole reply ---------------------------------------------------------------------------
    async def whole(self, acc: Accumulator) -> dict:
        """The reply's output items exactly as its stream would have them."""
        (choice,) = acc.choices
        finish = choice.finish_reason
        out = _StreamedOutput(self)
        out.scored(choice.token_ids, choice.logprobs)
        out.feed("".join(choice.text), finish)
        status = _status(finish)
        out.finish(status)
        return await self._finished(self._response(status, out.items, acc, finish))

    async def _finished(self, response: dict) -> dict:
        if self._store is not None:
            response["store"] = await self._store(response)
        return response

    # -- a background run's record -----------------------------------------------------------------
    async def queued(self) -> dict:
        """The response as a background request is answered: queued, stored (False: not)."""
        return await self._finished(self._response("queued", []))

    async def running(self) -> dict:
        """The response, and the stored record, of a background run whose first output came."""
        return await self._finished(self._response("in_progress", []))

    async def failed(self, body: dict, output: list[dict] = (), acc: Accumulator | None = None) -> dict:
        """The response of a reply ended by an error (OpenAI error JSON): failed, and why; a
        background run's record says so too."""
        e = body["error"]
        response = {**self._response("failed", list(output), acc),
                    "error": {"code": e.get("code") or e.get("type"), "message": e["message"]}}
        return await self._finished(response) if self.req.background else response

    # -- the stream ------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def error_event(self, body: dict) -> str:
        """An error while streaming: Responses' `error` event (OpenAI error JSON's fields)."""
        e = body["error"]
        self._error = body  # for the response.failed that follows
        return self.event("error", code=e.get("code"), message=e["message"], param=e.get("param"))

    async def events(self, steps: AsyncIterator[tuple[int, object]], acc: Accumulator,
                     head: bool = True) -> AsyncIterator[str]:
        """The stream: `steps` are the chat path's outputs (an error ends them as one string).
        `head`: begin with response.created and response.in_progress (a background run sends its own)."""
        if head:
            yield self.event("response.created", response=self._response("in_progress", []))
            yield self.event("response.in_progress", response=self._response("in_progress", []))
        out = _StreamedOutput(self)
        finish = None
        async for _, step in steps:
            if isinstance(step, str):  # the error event, then the response failed (OpenAI's two)
                yield step
                yield self.event("response.failed", response=await self.failed(self._error, out.items, acc))
                return
            for c in step.choices:
                finish = c.finish_reason or finish
                out.scored(c.token_ids, c.logprobs)
                for event in out.feed(c.text, c.finish_reason):
                    yield event
        status = _status(finish)
        for event in out.finish(status):
            yield event
        response = await self._finished(self._response(status, out.items, acc, finish))
        yield self.event(f"response.{status}", response=response)

    # -- the objects -----------------------------------------------------------------------------
    @staticmethod
    def _message(item_id: str, text: str | None, status: str) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _function_call(item_id: str, call: dict, status: str) -> dict:
        fn = call["function"]
        return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"], "status": status}

    def _response(self, status: str, output: list[dict], acc: Accumulator | None = None,
                  finish: str | None = None) -> dict:
        r = self.req
        text_format = r.text.format.echoed() if r.text is not None and r.text.format is not None else {"type": "text"}
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, FunctionChoice) else r.tool_choice or "auto"
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
               "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": output, "parallel_tool_calls": r.parallel_tool_calls,
               "temperature": 1.0 if r.temperature is None else r.temperature,
               "top_p": 1.0 if r.top_p is None else r.top_p, "tool_choice": choice,
               "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
               "text": {"format": text_format}, "truncation": r.truncation, "store": self._store is not None,
               "previous_response_id": r.previous_response_id, "metadata": r.metadata or {}, "user": r.user,
               "background": r.background, "top_logprobs": r.top_logprobs or 0 if r.logprobs_asked else None,
               "reasoning": r.reasoning or None,
               "usage": None}
        if acc is not None:
            u, (choice,) = acc.usage(), acc.choices
            thought = self.reasoning_tokens(choice.token_ids) if self.reasoning_tokens and choice.token_ids else 0
            # cache_write_tokens (a field OpenAI's type requires): not counted here, the engine does not
            # report which of a prompt's blocks it newly cached
            details = {**u["prompt_tokens_details"], "cache_write_tokens": 0}
            out["usage"] = {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
                            "output_tokens": u["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": thought}, "total_tokens": u["total_tokens"]}
        return out


class _StreamedOutput:
    """The output items of a stream as its text arrives (through the chat path's tool call parser
    when the request has tools): a message is added with its first text, each function call with
    its first fragment. As in OpenAI's streams one item is open at a time: the one before is done
    when the next is added (text after a call opens a message of its own), the last at the end."""

    def __init__(self, reply: ResponseReply) -> None:
        self.reply = reply
        self.parser = reply.plan.stream() if reply.plan.calls_tools else None
        self.splitter = ReasoningStream(reply.thinking) if reply.thinking is not None else None
        self.reasoning: dict | None = None  # its item, once reasoning came
        self.reasoning_text: list[str] = []  # closed when the answer's first item opens, as OpenAI's
        self.items: list[dict] = []
        self.message: dict | None = None
        self.text: list[str] = []
        self.calls: dict[int, dict] = {}  # chat's tool call index -> its item
        self.token_ids: list[int] = []  # the output's, when logprobs are asked
        self.logprobs: list[dict] = []  # their items
        self.skip = 0  # of which the reasoning's and earlier messages' (not the open message's)
        self.unsent = 0  # of which the text deltas have carried up to here
        self.tail = ""  # the text's last len(CLOSE) - 1 characters, where a close tag may have begun

    def scored(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> None:
        """Output tokens and their logprob entries (none unless the request asked for them)."""
        if self.reply.logprobs is not None and entries:
            self.token_ids += token_ids
            self.logprobs += self.reply.logprobs(token_ids, entries)

    def feed(self, text: str, finish_reason: str | None) -> list[str]:
        """One piece of the reply's text -> its events. It goes to the parser cut after each tool
        call block's close tag: a parser delta holds no text after its call, so the items come in
        the order of their text (a message after the call it follows), however the text came."""
        seen = self.tail + text
        cuts, at = [], seen.find(CLOSE)
        while at != -1:
            cuts.append(at + len(CLOSE) - len(self.tail))
            at = seen.find(CLOSE, at + len(CLOSE))
        self.tail = seen[len(seen) - len(CLOSE) + 1:]
        bounds = [0, *cuts, len(text)]
        events = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            events += self._feed(text[a:b], finish_reason if i == len(bounds) - 2 else None)
        return events

    def _feed(self, text: str, finish_reason: str | None) -> list[str]:
        events = []
        if self.splitter is not None:
            reasoning, text = self.splitter.step(text, final=finish_reason is not None)
            if reasoning:
                events += self._reason(reasoning)
        return events + self.add(self.parser.step(text, finish_reason)[0] if self.parser is not None
                                 else {"content": text})

    def _reason(self, text: str) -> list[str]:
        event, events = self.reply.event, []
        if self.reasoning is None:
            self.reasoning = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                              "status": "in_progress"}
            self.items.append(self.reasoning)
            events += [event("response.output_item.added", output_index=len(self.items) - 1, item=dict(self.reasoning)),
                       event("response.content_part.added", **self._at(self.reasoning), part=_reasoning_part(""))]
        self.reasoning_text.append(text)
        events.append(event("response.reasoning_text.delta", **self._at(self.reasoning), delta=text))
        return events

    def add(self, delta: dict) -> list[str]:
        events = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for fragment in delta.get("tool_calls", ()):
            events += self._call(fragment)
        return events

    def _text(self, text: str) -> list[str]:
        event, events = self.reply.event, []
        if self.message is None:
            if self.calls:  # a message after a call: without the whitespace between them
                text = text.lstrip()
                if not text:
                    return []
            events += self._open_message()
        self.text.append(text)
        events.append(event("response.output_text.delta", **self._where(), delta=text,
                            logprobs=self.logprobs[self.unsent:]))
        self.unsent = len(self.logprobs)
        return events

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        """`status`: the reply's, where it ended inside its reasoning."""
        if self.reasoning is None or self.reasoning["status"] != "in_progress":
            return []
        if self.logprobs and self.reply.reasoning_tokens is not None:  # its close tag is in: they are counted
            self.skip = self.unsent = self.reply.reasoning_tokens(self.token_ids)
        event, text, where = self.reply.event, "".join(self.reasoning_text), self._at(self.reasoning)
        self.reasoning.update(status=status, content=[_reasoning_part(text)])
        return [event("response.reasoning_text.done", **where, text=text),
                event("response.content_part.done", **where, part=_reasoning_part(text)),
                event("response.output_item.done", output_index=where["output_index"], item=self.reasoning)]

    def _open_message(self) -> list[str]:
        events = self._close_open()
        self.message = self.reply._message(new_id("msg"), None, "in_progress")
        self.items.append(self.message)
        index = len(self.items) - 1
        return events + [self.reply.event("response.output_item.added", output_index=index, item=self.message),
                         self.reply.event("response.content_part.added", **self._where(), part=_text_part(""))]

    def _where(self) -> dict:
        return self._at(self.message)

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _call(self, fragment: dict) -> list[str]:
        event = self.reply.event
        item = self.calls.get(fragment["index"])
        if item is None:
            events = self._close_open()
            first = {"id": fragment["id"], "function": {"name": fragment["function"]["name"], "arguments": ""}}
            item = self.calls[fragment["index"]] = self.reply._function_call(new_id("fc"), first, "in_progress")
            self.items.append(item)
            events.append(event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        else:
            events = []
        arguments = fragment.get("function", {}).get("arguments", "")
        if arguments:
            item["arguments"] += arguments
            events.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.items.index(item), delta=arguments))
        return events

    def finish(self, status: str) -> list[str]:
        events = []
        if not self.items:  # an empty reply is still a message
            events += self._open_message()
        if self.message is not None and self.unsent < len(self.logprobs):
            events += self._text("")  # tokens with no text of their own (the eos): their delta
        return events + self._close_open(status)  # reasoning still open: the reply ended inside it

    def _close_open(self, status: str = "completed") -> list[str]:
        """The done events of the item still open, before the next one is added or at the end
        (`status`: the reply's)."""
        events = self._close_reasoning(status) + self._close_message(status)
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                index = self.items.index(item)
                events += [self.reply.event("response.function_call_arguments.done", item_id=item["id"],
                                            output_index=index, name=item["name"], arguments=item["arguments"]),
                           self.reply.event("response.output_item.done", output_index=index, item=item)]
        return events

    def _close_message(self, status: str) -> list[str]:
        """The open message's done events: its part has the logprobs of the tokens its text deltas
        carried (the end token's too, at the reply's end); a call's tokens go with the message
        after the call, where one follows."""
        if self.message is None:
            return []
        event, text, where = self.reply.event, "".join(self.text), self._where()
        part = _text_part(text, self.logprobs[self.skip:self.unsent])
        self.message.update(status=status, content=[part])
        events = [event("response.output_text.done", **where, text=text, logprobs=part["logprobs"]),
                  event("response.content_part.done", **where, part=part),
                  event("response.output_item.done", output_index=where["output_index"], item=self.message)]
        self.message, self.text, self.skip = None, [], self.unsent
        return events


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _text_part(text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}

