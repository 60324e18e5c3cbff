"""An engine that replies to every request with a fixed text and records what it was sent, and
`run`, which puts the real HTTP app (and the official openai client) in front of it: the API's
edge tested on known text, without Ray or a model."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import openai
import uvicorn

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, PromptLogprob, RequestOutput
from router.api import build_api
from router.serving import OpenAIServing
from router.settings import RouterSettings
from workers.server import EngineServer


class ScriptedEngine:
    """Replies to every request with `script`, a few tokens a step; records what it was sent."""

    def __init__(self, tokenizer, script: str, finish_reason: str = "stop", stop_reason=None,
                 num_blocks: int = 256, cached: int = 0, step_s: float = 0.0) -> None:
        """`step_s`: how long each step takes."""
        self.tokenizer, self.script, self.num_blocks, self.cached = tokenizer, script, num_blocks, cached
        self.step_s = step_s
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.max_model_len = 4096
        self.vocab_size = len(tokenizer)
        self.seen: list[tuple[list[int], object]] = []
        self.request_ids: list[str] = []
        self.ended: dict[str, int] = {}  # request id -> the steps it was given before its stream ended

    async def generate(self, request_id: str, prompt: list[int], params):
        self.seen.append((prompt, params))
        self.request_ids.append(request_id)
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        sent, steps, given = "", [ids[i:i + 3] for i in range(0, len(ids), 3)], 0
        try:
            for k, step in enumerate(steps):
                await asyncio.sleep(self.step_s)
                text = self.tokenizer.decode(sum(steps[:k + 1], []))
                last = k == len(steps) - 1
                if not last and text.endswith("\ufffd"):  # a character cut between steps: its text waits, as the engine's
                    text = sent
                # asked for logprobs: each token at -0.5, with token 7 as the runner-up at -2.0
                lps = [{t: -0.5, 7: -2.0} for t in step] if params.logprobs is not None else None
                outs = [CompletionOutput(index=i, delta_text=text[len(sent):], delta_token_ids=step,
                                         delta_logprobs=lps, finish_reason=self.finish_reason if last else None,
                                         stop_reason=self.stop_reason if last else None) for i in range(params.n)]
                sent = text
                # asked for prompt logprobs: each prompt token after the first at -1.0, ranked first
                scored = ([None] + [PromptLogprob(t, -1.0, 1, ((t, -1.0),)) for t in prompt[1:]]
                          if params.prompt_logprobs is not None and k == 0 else None)
                given += 1
                yield RequestOutput(request_id, None, prompt, outs, finished=last, prompt_logprobs=scored,
                                    num_cached_tokens=self.cached)
        finally:
            self.ended[request_id] = given

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(num_total_blocks=self.num_blocks, num_free_blocks=self.num_blocks, block_size=16, num_running=0, num_waiting=0,
                           num_preemptions=0, prefix_query_tokens=0, prefix_hit_tokens=0, waiting_prefill_tokens=0)

    def routing_snapshot(self) -> EngineStats:
        return self.stats()

    def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


def run(tokenizer, script: str, go, settings: dict | None = None, config: dict | None = None, live: bool = False,
        **engine_kwargs):
    """go(client) against the app over a ScriptedEngine; -> (its result, the engine).
    `settings`: RouterSettings fields other than the defaults; `config`: EngineConfig's. `live`:
    served by uvicorn on a free loopback port (httpx's ASGI transport reads a stream whole before
    the client sees any of it)."""
    engine = ScriptedEngine(tokenizer, script, **engine_kwargs)
    server = EngineServer(EngineConfig(max_model_len=4096, max_num_seqs=4, **(config or {})), lambda config: engine)
    app = build_api(OpenAIServing(tokenizer, server, RouterSettings(served_model_name="m", **(settings or {}))))

    async def main():
        async with served(app, live) as (http, base_url):
            client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", http_client=http, max_retries=0)
            return await go(client)

    return asyncio.run(main()), engine


@contextlib.asynccontextmanager
async def served(app, live: bool = False):
    """-> (an httpx client of `app`, its base URL): in process, or (`live`) over loopback."""
    if not live:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://t") as http:
            yield http, "http://t"
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as http:
            yield http, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
        sock.close()
