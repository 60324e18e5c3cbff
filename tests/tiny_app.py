"""The HTTP app over a real in-process engine on a tiny random checkpoint, for the official openai
client (tests.tiny_llama writes the checkpoint)."""
from __future__ import annotations

import asyncio

import httpx
import openai

from engine.config import EngineConfig
from router.api import build_api
from router.serving import OpenAIServing
from router.settings import RouterSettings
from workers.server import EngineServer


def serve_tiny(model_dir: str, go, server_cls=EngineServer, max_num_seqs: int = 16, engine_kwargs: dict | None = None,
               settings_kwargs: dict | None = None):
    """-> go(openai client, engine server)'s result, the app serving `model_dir` as model "m"
    (the engine's and the ingress's other settings from the kwargs)."""
    from transformers import AutoTokenizer

    async def main():
        server = server_cls(EngineConfig(model=model_dir, max_model_len=256, num_gpu_blocks_override=64,
                                           max_num_seqs=max_num_seqs, block_size=16, **(engine_kwargs or {})))
        app = build_api(OpenAIServing(AutoTokenizer.from_pretrained(model_dir), server,
                                      RouterSettings(served_model_name="m", **(settings_kwargs or {}))))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http, max_retries=0)
                return await go(client, server)
        finally:
            await server.shutdown()

    return asyncio.run(main())
