"""vLLM's server flags, each honoured at the HTTP edge over a scripted engine (or taken, where
kvserve already does what it asks): --default-chat-template-kwargs, --return-tokens-as-token-ids,
--enable-force-include-usage, --sse-keep-alive-interval, --disable-fastapi-docs, --root-path,
--max-log-len, and the command line that sets them."""
from __future__ import annotations

import copy
import json
import logging

import httpx
import pytest

from cluster.app import router_settings, split_args
from router.settings import RouterSettings
from tests.scripted_engine import run

USER = [{"role": "user", "content": "Is the sky blue?"}]


def _http(client) -> httpx.AsyncClient:
    """A plain HTTP client of the server (served live) the openai `client` talks to."""
    return httpx.AsyncClient(base_url=str(client.base_url).removesuffix("/v1/").removesuffix("/v1"), timeout=30)


def test_default_chat_template_kwargs_sit_under_the_requests_own(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail | default('') }}"
    defaults = {"default_chat_template_kwargs": {"tail": " Answer:"}}

    def chat(**extra):
        return lambda client: client.chat.completions.create(model="m", messages=USER, max_tokens=1, **extra)

    _, engine = run(tok, "yes", chat(), settings=defaults)
    assert tok.decode(engine.seen[0][0]) == "Is the sky blue? Answer:"
    _, engine = run(tok, "yes", chat(extra_body={"chat_template_kwargs": {"tail": " A:"}}), settings=defaults)
    assert tok.decode(engine.seen[0][0]) == "Is the sky blue? A:"  # the request's wins
    tok.chat_template = "{{ messages[0]['content'] }} effort={{ reasoning_effort | default('none') }}"
    _, engine = run(tok, "yes", chat(reasoning_effort="high"), settings={"default_chat_template_kwargs":
                                                                          {"reasoning_effort": "low"}})
    assert tok.decode(engine.seen[0][0]).endswith("effort=high")  # the request's field over the default
    _, engine = run(tok, "yes", chat(), settings={"default_chat_template_kwargs": {"reasoning_effort": "low"}})
    assert tok.decode(engine.seen[0][0]).endswith("effort=low")
    with pytest.raises(ValueError, match="default_chat_template_kwargs may not set tools"):
        RouterSettings(served_model_name="m", default_chat_template_kwargs={"tools": []})


def test_the_servers_return_tokens_as_token_ids_unless_a_request_says(tokenizer):
    def tokens(**extra):
        async def go(client):
            r = await client.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=1, **extra)
            return r.choices[0].logprobs.tokens
        return go

    as_ids, _ = run(tokenizer, "yes", tokens(), settings={"return_tokens_as_token_ids": True})
    assert as_ids and all(t.startswith("token_id:") for t in as_ids)
    as_text, _ = run(tokenizer, "yes", tokens(extra_body={"return_tokens_as_token_ids": False}),
                     settings={"return_tokens_as_token_ids": True})
    assert "".join(as_text) == "yes"
    default, _ = run(tokenizer, "yes", tokens())
    assert "".join(default) == "yes"


def test_force_include_usage_puts_usage_in_every_stream(tokenizer):
    async def go(client):
        stream = await client.chat.completions.create(model="m", messages=USER, max_tokens=8, stream=True)
        return [c async for c in stream]

    chunks, _ = run(tokenizer, "Yes, it is blue.", go, settings={"enable_force_include_usage": True})
    assert all(c.usage is not None for c in chunks)  # continuous: the usage so far in each
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(tokenizer.encode("Yes, it is blue."))
    chunks, _ = run(tokenizer, "Yes, it is blue.", go)
    assert all(c.usage is None for c in chunks)  # without it, only where a request asks


def test_an_idle_stream_sends_keep_alive_comments_that_clients_skip(tokenizer):
    script = "Yes, it is blue today."

    async def raw(client):
        async with _http(client) as http, http.stream(
                "POST", "/v1/chat/completions",
                json={"model": "m", "messages": USER, "max_tokens": 16, "stream": True}) as r:
            return [line async for line in r.aiter_lines()]

    async def text(client):
        stream = await client.chat.completions.create(model="m", messages=USER, max_tokens=16, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    slow = {"step_s": 0.25}
    lines, engine = run(tokenizer, script, raw, settings={"sse_keep_alive_interval": 0.05}, live=True, **slow)
    assert lines.count(": keep-alive") >= 3  # between the steps
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"]) == script
    assert [line for line in lines if line][-1] == "data: [DONE]"
    (given,) = engine.ended.values()
    assert given == -(-len(tokenizer.encode(script, add_special_tokens=False)) // 3)  # every step: ran to its end
    said, _ = run(tokenizer, script, text, settings={"sse_keep_alive_interval": 0.05}, live=True, **slow)
    assert said == script  # the openai client skips the comments
    lines, _ = run(tokenizer, script, raw, live=True, **slow)
    assert ": keep-alive" not in lines  # off by default, as vLLM's


def test_the_keep_alive_wrapper_closes_its_body_and_keeps_cancellation():
    import asyncio

    from router.keep_alive import COMMENT, KeepAlive

    closed = []

    async def body(events, cleanup_s=0.0):
        try:
            for e in events:
                await asyncio.sleep(0.05)
                yield e
        finally:
            await asyncio.sleep(cleanup_s)  # e.g. aborting its engine request
            closed.append(events)

    async def main():
        got = [e async for e in KeepAlive(body(["a", "b"]), 0.02)]
        assert [e for e in got if e != COMMENT] == ["a", "b"] and COMMENT in got
        class Body:  # an iterator with its own close, as a stream over engine calls already sent
            def __aiter__(self):
                return self

            async def __anext__(self):
                raise StopAsyncIteration

            async def aclose(self):
                closed.append("never read")

        await KeepAlive(Body(), 1.0).aclose()  # a reply whose first byte never went: its body is closed
        assert "never read" in closed

        async def failing():
            yield "a"
            raise RuntimeError("engine died")
        with pytest.raises(RuntimeError, match="engine died"):
            [e async for e in KeepAlive(failing(), 1.0)]

        slow = KeepAlive(body(["s", "t"], cleanup_s=0.3), 0.01)
        assert await anext(slow) == COMMENT  # mid-step now
        closer = asyncio.create_task(slow.aclose())
        await asyncio.sleep(0.1)  # inside the body's cleanup
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer  # the closer's own cancellation is not swallowed (it reaches the body's cleanup too)

    asyncio.run(main())


def test_a_client_leaving_a_kept_alive_stream_ends_its_engine_request(tokenizer):
    async def leave(client):
        async with _http(client) as http, http.stream(
                "POST", "/v1/chat/completions",
                json={"model": "m", "messages": USER, "max_tokens": 64, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # the first token, then gone
        import asyncio

        await asyncio.sleep(1.0)

    script = "one two three four five six seven eight nine ten eleven twelve"
    _, engine = run(tokenizer, script, leave, settings={"sse_keep_alive_interval": 0.05}, live=True, step_s=0.2)
    steps = len(tokenizer.encode(script, add_special_tokens=False)) // 3
    (given,) = engine.ended.values()
    assert given < steps  # its stream was closed mid-way, not run to the end


def test_docs_can_be_turned_off_and_the_api_served_under_a_root_path(tokenizer):
    async def get(client, *paths):
        async with _http(client) as http:
            return [(await http.get(p)) for p in paths]

    (doc, docs), _ = run(tokenizer, "yes", lambda c: get(c, "/openapi.json", "/docs"),
                         settings={"disable_fastapi_docs": True}, live=True)
    assert doc.status_code == 404 and docs.status_code == 404
    (doc,), _ = run(tokenizer, "yes", lambda c: get(c, "/openapi.json"), live=True)
    assert doc.status_code == 200

    got, _ = run(tokenizer, "yes", lambda c: get(c, "/llm/v1/models", "/v1/models", "/llm/health", "/llm/openapi.json"),
                 settings={"root_path": "/llm"}, live=True)
    assert [r.status_code for r in got] == [200, 200, 200, 200]
    assert got[0].json()["data"][0]["id"] == "m"
    assert got[3].json()["servers"] == [{"url": "/llm"}]


def test_load_counts_the_requests_running_the_model(tokenizer):
    import asyncio

    async def go(client):
        async with _http(client) as http:
            idle = (await http.get("/load")).json()
            stream = await client.chat.completions.create(model="m", messages=USER, max_tokens=16, stream=True)
            await anext(aiter(stream))  # running now
            busy = (await http.get("/load")).json()
            await stream.close()
            await asyncio.sleep(0.2)
            return idle, busy, (await http.get("/load")).json()

    loads, _ = run(tokenizer, "Yes, it is blue today and tomorrow.", go, settings={"enable_server_load_tracking": True},
                   live=True, step_s=0.1)
    assert loads == ({"server_load": 0}, {"server_load": 1}, {"server_load": 0})

    async def untracked(client):
        async with _http(client) as http:
            stream = await client.chat.completions.create(model="m", messages=USER, max_tokens=16, stream=True)
            await anext(aiter(stream))  # running, and not counted
            load = await http.get("/load")
            await stream.close()
            return load.status_code, load.json(), (await http.get("/tokenizer_info")).status_code
    # as vLLM 0.32's: /load is always there, at 0 without the flag; /tokenizer_info is off by default
    assert run(tokenizer, "yes", untracked, live=True, step_s=0.1)[0] == (200, {"server_load": 0}, 404)


def test_tokenizer_info_shows_the_tokenizer_and_its_template(tokenizer):
    async def go(client):
        async with _http(client) as http:
            return (await http.get("/tokenizer_info")).json()

    info, _ = run(tokenizer, "yes", go, settings={"enable_tokenizer_info_endpoint": True}, live=True)
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and "vocab_file" not in info and "tokenizer_file" not in info
    json.dumps(info)


def test_max_log_len_shortens_the_logged_prompt(tokenizer, caplog):
    async def go(client):
        await client.completions.create(model="m", prompt=list(range(100, 140)), max_tokens=1)

    with caplog.at_level(logging.INFO, logger="router.serving"):
        run(tokenizer, "yes", go, settings={"enable_log_requests": True, "max_log_len": 5})
    (line,) = [r.getMessage() for r in caplog.records if "prompt token ids" in r.getMessage()]
    assert "[[100, 101, 102, 103, 104]]" in line and "105" not in line.split("]]")[0]


def test_log_outputs_logs_each_samples_text_when_it_ends(tokenizer, caplog):
    async def go(client):
        await client.completions.create(model="m", prompt="hi", max_tokens=8, n=2)
        stream = await client.chat.completions.create(model="m", messages=USER, max_tokens=8, stream=True)
        async for _ in stream:
            pass

    settings = {"enable_log_requests": True, "enable_log_outputs": True, "max_log_len": 6}
    with caplog.at_level(logging.DEBUG, logger="router.engine_streams"):
        run(tokenizer, "Yes, it is blue.", go, settings=settings)
    lines = [r.getMessage() for r in caplog.records if ": generated " in r.getMessage()]
    texts = [line for line in lines if "finish_reason stop" in line]
    assert len(texts) == 3 and all("'Yes, i'" in line for line in texts)  # 2 samples, then the stream; cut at 6
    assert len([line for line in lines if "generated token ids" in line]) == 3
    with pytest.raises(ValueError, match="enable_log_outputs .* needs enable_log_requests"):
        RouterSettings(served_model_name="m", enable_log_outputs=True)


def test_the_command_line_sets_them(tokenizer):
    from cluster.cli import build_parser, vllm_argv
    from cluster.serve_cli import app_args_from_cli

    parser = build_parser()
    argv = ["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}', "--return-tokens-as-token-ids",
            "--enable-force-include-usage", "--sse-keep-alive-interval", "5", "--disable-fastapi-docs",
            "--root-path", "/llm", "--max-log-len", "10", "--shutdown-timeout", "0", "--enable-request-id-headers",
            "--enable-prompt-tokens-details", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
            "--enable-log-requests", "--enable-log-outputs",
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true, "reasoning_parser": "qwen3", '
            '"enable_in_reasoning": true}']
    engine, options = split_args(app_args_from_cli(parser.parse_args(vllm_argv(parser, argv))))
    settings = router_settings(engine, options)
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    assert settings.return_tokens_as_token_ids and settings.enable_force_include_usage and settings.disable_fastapi_docs
    assert (settings.sse_keep_alive_interval, settings.root_path, settings.max_log_len) == (5.0, "/llm", 10)
    assert options.graceful_shutdown_timeout_s == 0
    assert settings.enable_server_load_tracking and settings.enable_tokenizer_info_endpoint
    assert settings.enable_log_outputs and settings.enable_log_requests
    assert (settings.reasoning_parser, settings.structured_outputs_in_reasoning) == ("qwen3", True)
    for config, message in [('{"backend": "x"}', "backend must be"), ('{"reasoning_parser": "deepseek_r1"}',
                                                                       "disagree; give one")]:
        with pytest.raises(ValueError, match=message):
            router_settings(*split_args(app_args_from_cli(parser.parse_args(
                ["serve", "--reasoning-parser", "qwen3", "--structured-outputs-config", config]))))
    from engine.vllm_args import without_vllm_only

    assert without_vllm_only({"structured_outputs_config": {"backend": "guidance"}}) == {}  # LLM(...)'s keyword
    with pytest.raises(ValueError, match="'foo' is not one of its keys"):
        without_vllm_only({"structured_outputs_config": {"foo": 1}})
    settings = router_settings(*split_args(app_args_from_cli(parser.parse_args(["serve"]))))
    assert settings.default_chat_template_kwargs is None and settings.root_path is None
    assert not (settings.return_tokens_as_token_ids or settings.enable_force_include_usage
                or settings.disable_fastapi_docs or settings.sse_keep_alive_interval)
