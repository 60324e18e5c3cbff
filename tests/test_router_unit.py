"""The router without Ray: the HTTP app over an in-process EngineServer + FakeEngine, the app
builder's argument handling and the `kvserve serve` command line."""
import asyncio
import concurrent.futures
import importlib.metadata
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.app import engine_bundles, engine_deployment_options, served_model_name, split_args
from cluster.cli import build_parser
from cluster.serve_cli import app_args_from_cli, ready_message
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.outputs import ChoiceDelta, StepOutput
from router.api import build_api
from router.serving import OpenAIServing
from router.settings import RouterSettings
from tests.local_serve import free_port
from workers.server import EngineServer

ROOT = Path(__file__).resolve().parents[1]


def call(tokenizer, method: str, path: str, num_blocks: int = 64, engine=None, **kwargs) -> httpx.Response:
    """One request to a fresh app over an in-process FakeEngine (the fake is loop-bound), or over
    `engine` when given."""
    settings = RouterSettings(served_model_name="m", api_key=kwargs.pop("api_key", None))
    config = EngineConfig(max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=num_blocks)
    engine = engine or EngineServer(config, "tests.fake_engine:FakeEngine")
    app = build_api(OpenAIServing(tokenizer, engine, settings))

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is a response too
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def events(r: httpx.Response) -> list:
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streamed_chat_with_n_sends_a_role_chunk_per_choice(tokenizer):
    r = call(tokenizer, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = events(r)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks[2:-1]}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


class HalfCharEngine:
    """Three engine steps; the first two tokens are each half of one UTF-8 character, so the
    detokenizer holds their text back and only the last step has text."""

    async def info(self) -> dict:
        return {"max_model_len": 64, "max_num_seqs": 4}

    async def generate(self, request_id, prompt_token_ids, params, admitted=False):
        n = len(prompt_token_ids)
        yield StepOutput([ChoiceDelta(0, "", [1], None)], n, 0, False)
        yield StepOutput([ChoiceDelta(0, "", [2], None)], n, 0, False)
        yield StepOutput([ChoiceDelta(0, "\u00e9!", [3], None, "length")], n, 0, True)


class RaisingEngine:
    """An engine client whose first generate step raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def info(self) -> dict:
        return {"max_model_len": 64, "max_num_seqs": 4}

    async def generate(self, request_id, prompt_token_ids, params, admitted=False):
        raise self.error
        yield  # an async generator


def test_an_invalid_request_error_is_a_400_naming_its_field_and_any_other_error_a_500(tokenizer):
    body = {"prompt": "hi", "max_tokens": 3}
    r = call(tokenizer, "POST", "/v1/completions", engine=RaisingEngine(
        InvalidRequestError("max_tokens", "too many for this cache", code="context_length_exceeded")), json=body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "too many for this cache", "type": "invalid_request_error",
                                 "param": "max_tokens", "code": "context_length_exceeded"}
    # A ValueError that is not a typed request error is the server's fault, whatever it says.
    r = call(tokenizer, "POST", "/v1/completions", engine=RaisingEngine(ValueError("prompt max_model_len")),
             json=body)
    assert r.status_code == 500 and "max_model_len" not in r.text


class FirstAndLastEngine:
    """Records the params it is sent; answers as the engine answers a FINAL_ONLY request: the
    first token, then one output holding the rest."""

    def __init__(self) -> None:
        self.params = []

    async def info(self) -> dict:
        return {"max_model_len": 64, "max_num_seqs": 4}

    async def generate(self, request_id, prompt_token_ids, params, admitted=False):
        self.params.append(params)
        n = len(prompt_token_ids)
        yield StepOutput([ChoiceDelta(0, "Hel", [1], None)], n, 0, False)
        yield StepOutput([ChoiceDelta(0, "lo there", [2, 3, 4], None, "length")], n, 0, True)


def test_the_engines_limits_are_asked_again_after_a_while(tokenizer, monkeypatch):
    """A config change replaces the engine replicas (a new max_model_len) while the ingress may
    have asked an old one: the ingress asks again once its answer is LIMITS_TTL_S old, in the
    background (asking waits for a seat on a busy replica), and keeps the last answer while no
    engine answers. Only the first request waits for them, and concurrent first requests ask once."""
    import router.serving

    class Changing:
        def __init__(self):
            self.info_now: dict | Exception = {"max_model_len": 512, "max_num_seqs": 4}
            self.asked = 0

        async def info(self):
            self.asked += 1
            await asyncio.sleep(0.05)
            if isinstance(self.info_now, Exception):
                raise self.info_now
            return dict(self.info_now)

    engine = Changing()
    serving = OpenAIServing(tokenizer, engine, RouterSettings(served_model_name="m"))

    async def go():
        firsts = await asyncio.gather(*[serving.limits() for _ in range(5)])
        seen = [[f["max_model_len"] for f in firsts], engine.asked]
        engine.info_now = {"max_model_len": 1024, "max_num_seqs": 4}
        seen.append((await serving.limits())["max_model_len"])  # within the TTL: no new trip
        monkeypatch.setattr(router.serving, "LIMITS_TTL_S", 0.0)
        seen.append((await serving.limits())["max_model_len"])  # stale: the last, while asking again
        await asyncio.wait_for(asyncio.shield(serving._refresh), 30)  # not a sleep: a loaded host is slow
        seen += [(await serving.limits())["max_model_len"], engine.asked]
        engine.info_now = RuntimeError("no replica")
        await serving.limits()
        await asyncio.wait_for(asyncio.shield(serving._refresh), 30)
        seen.append((await serving.limits())["max_model_len"])
        return seen

    assert asyncio.run(go()) == [[512] * 5, 1, 512, 512, 1024, 2, 1024]


def test_an_engine_that_never_says_its_limits_is_a_503_not_a_hung_request(tokenizer, monkeypatch):
    """The first request waits LIMITS_TIMEOUT_S for the engine's limits, then gets OpenAI error
    JSON; a later one asks again. A refresh that never returns gives up too, and one is asked
    again a TTL later (a hung refresh would have kept the limits stale for good)."""
    import router.serving

    monkeypatch.setattr(router.serving, "LIMITS_TIMEOUT_S", 0.05)

    class Mute:
        def __init__(self):
            self.asked, self.answer = 0, False

        async def info(self):
            self.asked += 1
            if not self.answer:
                await asyncio.sleep(3600)
            return {"max_model_len": 64, "max_num_seqs": 4}

    engine = Mute()
    r = call(tokenizer, "POST", "/v1/completions", engine=engine, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable" and "limits" in r.text
    assert int(r.headers["Retry-After"]) >= 1 and engine.asked == 1

    serving = OpenAIServing(tokenizer, engine, RouterSettings(served_model_name="m"))

    async def go():
        engine.answer = True
        first = await serving.limits()
        engine.answer = False
        monkeypatch.setattr(router.serving, "LIMITS_TTL_S", 0.0)
        await serving.limits()  # stale: asks in the background, which never answers
        await asyncio.wait_for(asyncio.shield(serving._refresh), 30)  # it gives up (LIMITS_TIMEOUT_S)
        return first, serving._refresh.done(), engine.asked

    assert asyncio.run(go()) == ({"max_model_len": 64, "max_num_seqs": 4}, True, 3)


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, lambda r: r["choices"][0]["text"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
     lambda r: r["choices"][0]["message"]["content"]),
])
def test_a_reply_sent_whole_asks_the_engine_for_its_final_output_only(tokenizer, path, body, text_of):
    """stream: false -> RequestOutputKind.FINAL_ONLY (no output per token from the engine, nor a
    message per token over Ray); streamed requests keep DELTA."""
    from engine.sampling_params import RequestOutputKind

    engine = FirstAndLastEngine()
    r = call(tokenizer, "POST", path, engine=engine, json=body)
    assert r.status_code == 200 and text_of(r.json()) == "Hello there"
    assert r.json()["usage"]["completion_tokens"] == 4
    call(tokenizer, "POST", path, engine=engine, json={**body, "stream": True})
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA]


def test_a_temperature_over_openais_2_is_served_as_vllm_serves_it(tokenizer):
    engine = FirstAndLastEngine()
    r = call(tokenizer, "POST", "/v1/completions", engine=engine, json={"prompt": "hi", "temperature": 5})
    assert r.status_code == 200 and engine.params[0].temperature == 5


def test_sampling_params_errors_name_their_field():
    from engine.sampling_params import SamplingParams

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=0)
    assert e.value.param == "top_p" and e.value.message.startswith("top_p must be")


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/completions", {"prompt": "hi"}, lambda c: c["text"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     lambda c: c["delta"].get("content")),
])
def test_a_step_whose_text_is_held_back_still_streams_a_chunk(tokenizer, path, body, text_of):
    r = call(tokenizer, "POST", path, engine=HalfCharEngine(), json={**body, "max_tokens": 3, "stream": True})
    chunks = [c for c in events(r) if "role" not in c["choices"][0].get("delta", {})]
    assert [text_of(c["choices"][0]) for c in chunks] == ["", "", "\u00e9!"]  # first token: first chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_streamed_batch_of_prompts_numbers_choices_by_prompt(tokenizer):
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": [[1, 2], [3, 4]], "n": 2, "max_tokens": 2,
                                                         "stream": True})
    text = {}
    for c in events(r):
        choice = c["choices"][0]
        text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert text == {0: "1 2 ", 1: "1 2 ", 2: "3 4 ", 3: "3 4 "}  # the fake echoes each prompt


def test_streamed_completion_logprobs_offsets_continue_across_chunks(tokenizer):
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": [10, 20, 30], "max_tokens": 3, "logprobs": 0,
                                                         "stream": True})
    offsets = [o for c in events(r) for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [tokenizer.decode([t]) for t in (10, 20, 30)]
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


class SilentServer(EngineServer):
    """A replica whose info() does not give its KV cache's size: only its engine can refuse."""

    async def info(self) -> dict:
        info = await super().info()
        return {k: v for k, v in info.items() if k not in ("num_total_blocks", "block_size")}


@pytest.mark.parametrize("server", [EngineServer, SilentServer])
def test_a_request_the_kv_cache_can_never_fit_is_a_400(tokenizer, server):
    # The ingress refuses it from the replica's info(); the engine's own InvalidRequestError is
    # a 400 too, for a replica that does not say.
    config = EngineConfig(max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=2)
    r = call(tokenizer, "POST", "/v1/completions", engine=server(config, "tests.fake_engine:FakeEngine"),
             json={"prompt": [1] * 10, "max_tokens": 40})
    said = "The KV cache holds 32 tokens" if server is EngineServer else "more KV blocks than the cache has"
    assert r.status_code == 400 and said in r.json()["error"]["message"], r.json()


def test_open_paths_need_no_key(tokenizer):
    assert call(tokenizer, "GET", "/health", api_key="k").status_code == 200
    assert call(tokenizer, "HEAD", "/health", api_key="k").status_code == 200  # load balancers probe with HEAD
    assert call(tokenizer, "GET", "/ready", api_key="k").json() == {"ready": True}
    assert call(tokenizer, "GET", "/version", api_key="k").json() == {"version": importlib.metadata.version("kvserve")}
    assert call(tokenizer, "GET", "/v1/models", api_key="k").status_code == 401
    ok = call(tokenizer, "GET", "/v1/models", api_key="k", headers={"Authorization": "Bearer k"})
    assert ok.json()["data"][0]["id"] == "m"


def test_every_served_model_name_is_answered_and_replies_name_the_first(tokenizer):
    from cluster.app import router_settings

    engine, options = split_args({"served_model_name": ["first", "org/second"]})
    settings = router_settings(engine, options)
    assert (settings.served_model_name, settings.served_model_aliases) == ("first", ("org/second",))
    config = EngineConfig(max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=64)
    app = build_api(OpenAIServing(tokenizer, EngineServer(config, "tests.fake_engine:FakeEngine"), settings))

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            listed = (await c.get("/v1/models")).json()
            reply = await c.post("/v1/completions", json={"model": "org/second", "prompt": "hi", "max_tokens": 2})
            other = await c.post("/v1/completions", json={"model": "third", "prompt": "hi", "max_tokens": 2})
            return listed, reply, other

    listed, reply, other = asyncio.run(go())
    assert [m["id"] for m in listed["data"]] == ["first", "org/second"]
    assert reply.status_code == 200 and reply.json()["model"] == "first"  # vLLM's rule
    assert other.status_code == 404
    ns = build_parser().parse_args(["serve", "--served-model-name", "first", "org/second"])
    assert app_args_from_cli(ns)["served_model_name"] == ["first", "org/second"]


# -- the app builder -------------------------------------------------------------------------------

def test_a_tokenizer_that_is_not_a_directory_is_refused_before_ray_starts(tmp_path):
    from cluster.app import check_args
    from engine.model_source import ModelError

    with pytest.raises(ModelError, match="tokenizer path '/nonexistent' does not exist"):
        check_args({"tokenizer": "/nonexistent"})  # not found by each replica in turn
    with pytest.raises(ModelError, match="tokenizer 'org/tok' is neither a local directory nor in the Hugging Face "
                                         f"cache: no snapshot of 'org/tok' at revision 'main' under '{tmp_path}'"):
        check_args({"tokenizer": "org/tok", "download_dir": str(tmp_path)})
    r = kvserve("serve", "--tokenizer", str(tmp_path / "missing"), "--port", "1")
    assert r.returncode == 2 and r.stderr.strip().startswith(
        f"kvserve: error: tokenizer path '{tmp_path / 'missing'}' does not exist (give a local directory"), r.stderr


def test_split_args_routes_keys_and_rejects_unknown_ones():
    engine, options = split_args({"model": None, "max_model_len": 512, "num_replicas": 2, "api_key": "k"})
    assert engine.max_model_len == 512 and options.num_replicas == 2 and options.api_key == "k"
    with pytest.raises(ValueError, match=r"max_model_length \(did you mean max_model_len\?\)"):
        split_args({"max_model_length": 512})
    with pytest.raises(ValueError, match="max_num_seqs"):
        split_args({"max_num_seqs": 0})
    from cluster.app import router_settings

    cors = router_settings(*split_args(app_args_from_cli(build_parser().parse_args(
        ["serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials"]))))
    assert (cors.allowed_origins, cors.allowed_methods, cors.allow_credentials) == (("https://a.example",), ("*",), True)
    parsed = router_settings(*split_args(app_args_from_cli(build_parser().parse_args(
        ["serve", "--reasoning-parser", "deepseek_r1", "--response-role", "bot",
         "--chat-template-content-format", "openai", "--tool-call-parser", "llama3_json",
         "--enable-auto-tool-choice", "--exclude-tools-when-tool-choice-none"]))))  # the first: done anyway
    assert (parsed.reasoning_parser, parsed.response_role, parsed.chat_template_content_format,
            parsed.tool_call_parser, parsed.exclude_tools_when_tool_choice_none) == (
        "deepseek_r1", "bot", "openai", "llama3_json", True)
    assert not router_settings(*split_args({})).exclude_tools_when_tool_choice_none
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        router_settings(*split_args({"chat_template_content_format": "json"}))
    with pytest.raises(ValueError, match="response_role must be a non-empty string"):
        router_settings(*split_args({"response_role": ""}))
    with pytest.raises(ValueError, match="max_queued_requests"):
        split_args({"max_queued_requests": 0})


def test_split_args_reads_templated_strings_and_names_an_argument_of_the_wrong_type():
    """serveConfigV2 from Helm or kustomize often quotes every value."""
    engine, options = split_args({"max_model_len": "512", "enable_prefix_caching": "false", "num_replicas": "2",
                                  "graceful_shutdown_timeout_s": "300"})
    assert (engine.max_model_len, engine.enable_prefix_caching) == (512, False)
    assert (options.num_replicas, options.graceful_shutdown_timeout_s) == (2, 300.0)
    for args, says in [({"max_model_len": "abc"}, "max_model_len='abc': Input should be a valid integer"),
                       ({"max_num_seqs": 8.5}, "max_num_seqs=8.5: Input should be a valid integer"),
                       ({"api_key": 12345678}, "api_key=12345678: Input should be a valid string"),
                       ({"check_nodes": "maybe"}, "check_nodes='maybe': Input should be a valid boolean")]:
        with pytest.raises(ValueError) as e:
            split_args(args)
        assert str(e.value).startswith(says), e.value


def test_served_model_name():
    assert served_model_name(*split_args({})) == "SmolLM2-135M-Instruct"
    assert served_model_name(*split_args({"model": "/models/llama"})) == "/models/llama"
    assert served_model_name(*split_args({"model": "/m", "served_model_name": "x"})) == "x"


def test_tensor_parallel_replicas_get_a_placement_group():
    assert engine_bundles(2, use_gpu=True) == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    opts = engine_deployment_options(*split_args({"tensor_parallel_size": 2, "device": "cpu", "max_num_seqs": 8}))
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}] * 3
    resources = {k: v for k, v in opts["ray_actor_options"].items() if k != "runtime_env"}
    assert resources == {"num_cpus": 1}  # fits bundle 0
    assert opts["max_ongoing_requests"] == 8  # sized to the engine's batch
    single = engine_deployment_options(*split_args({"device": "cuda"}))
    assert "placement_group_bundles" not in single and single["ray_actor_options"]["num_gpus"] == 1


def test_settings_are_validated():
    with pytest.raises(ValueError, match="overload_status"):
        RouterSettings(served_model_name="m", overload_status=500)
    with pytest.raises(ValueError, match="api_key"):
        RouterSettings(served_model_name="m", api_key="")
    with pytest.raises(ValueError, match="not both"):
        RouterSettings(served_model_name="m", api_key="k", api_key_env="KEY")


def test_api_key_can_come_from_the_ingress_environment(monkeypatch):
    settings = RouterSettings(served_model_name="m", api_key_env="KVSERVE_TEST_KEY")
    monkeypatch.delenv("KVSERVE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="KVSERVE_TEST_KEY"):  # never an open server by accident
        settings.resolve_api_key()
    monkeypatch.setenv("KVSERVE_TEST_KEY", "sk-from-secret")
    assert settings.resolve_api_key().api_key == "sk-from-secret"
    assert RouterSettings(served_model_name="m", api_key="k").resolve_api_key().api_key == "k"


# -- kvserve serve ---------------------------------------------------------------------------------

def test_serve_flags_map_onto_app_args():
    ns = build_parser().parse_args(["serve", "--port", "9000", "--api-key", "k", "-tp", "2", "--num-replicas", "3",
                                    "--max-model-len", "1024", "--max-num-seqs", "8", "--max-queued-requests", "16",
                                    "--served-model-name", "smol", "--api-server-count", "2"])
    assert (ns.host, ns.port) == ("127.0.0.1", 9000)
    assert app_args_from_cli(ns) == {"api_key": "k", "tensor_parallel_size": 2, "num_replicas": 3,
                                     "max_model_len": 1024, "max_num_seqs": 8, "max_queued_requests": 16,
                                     "served_model_name": "smol", "num_ingress_replicas": 2}
    split_args(app_args_from_cli(ns))


def test_vllm_spellings_of_serve_flags():
    def parsed(*flags):
        return app_args_from_cli(build_parser().parse_args(["serve", *flags]))

    assert parsed("--disable-log-requests")["enable_log_requests"] is False  # vLLM's older flag
    assert parsed("--enable-log-requests")["enable_log_requests"] is True
    assert "enable_log_requests" not in parsed()
    assert parsed("--disable-log-stats")["disable_log_stats"] is True and "disable_log_stats" not in parsed()
    engine, _ = split_args(parsed("--max-logprobs", "-1"))
    assert engine.max_logprobs == -1 and split_args(parsed())[0].max_logprobs == 20
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        split_args(parsed("--max-logprobs", "-2"))


def test_access_lines_off_reach_both_deployments():
    from cluster.app import engine_deployment_options, ingress_deployment_options

    engine, options = split_args(app_args_from_cli(build_parser().parse_args(["serve", "--disable-uvicorn-access-log"])))
    for opts in (engine_deployment_options(engine, options), ingress_deployment_options(options)):
        assert opts["logging_config"] == {"enable_access_log": False}
    engine, options = split_args({})
    assert "logging_config" not in engine_deployment_options(engine, options)  # Serve's defaults
    assert "logging_config" not in ingress_deployment_options(options)
    from ray.serve.schema import LoggingConfig

    engine, options = split_args(app_args_from_cli(build_parser().parse_args(
        ["serve", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"])))
    for opts in (engine_deployment_options(engine, options), ingress_deployment_options(options)):
        assert opts["logging_config"] == {"enable_access_log": False, "log_level": "WARNING"}
        assert LoggingConfig(**opts["logging_config"]).log_level == "WARNING"  # as Serve reads it
    _, trace = split_args({"uvicorn_log_level": "trace"})
    assert ingress_deployment_options(trace)["logging_config"] == {"log_level": "DEBUG"}
    with pytest.raises(ValueError, match="uvicorn_log_level must be one of critical, error"):
        split_args({"uvicorn_log_level": "loud"})


def test_more_than_one_ingress_replica_routes_drain_calls_to_each():
    from cluster.app import ingress_deployment_options
    from cluster.ingress_router import IngressRequestRouter

    def router(**args):
        config = ingress_deployment_options(split_args(args)[1]).get("request_router_config")
        return config and config.request_router_class

    assert router() is None and router(num_ingress_replicas=1) is None  # Serve's default for one
    assert router(num_ingress_replicas=2) == f"{IngressRequestRouter.__module__}:{IngressRequestRouter.__name__}"
    assert router(ingress_autoscaling_config={"min_replicas": 1, "max_replicas": 4}) is None  # kvserve serve never


def test_ready_message_has_a_working_curl_and_never_the_key(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "k3y")
    msg = ready_message("0.0.0.0", 8000, "smol", api_key="k3y")
    assert "http://127.0.0.1:8000/v1/chat/completions" in msg and "$KVSERVE_API_KEY" in msg
    body = msg.split("-d '", 1)[1].rstrip("'")
    assert json.loads(body)["model"] == "smol"
    msg = ready_message("0.0.0.0", 8000, "smol", api_key="given-on-the-command-line")
    assert "given-on-the-command-line" not in msg and "Bearer <the --api-key>" in msg  # not $KVSERVE_API_KEY: a 401
    monkeypatch.delenv("KVSERVE_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "v-k3y")
    assert "Bearer $VLLM_API_KEY" in ready_message("0.0.0.0", 8000, "smol", api_key="v-k3y")
    msg = ready_message("0.0.0.0", 8000, "smol", api_key=None, pooling="embed")  # an embedding model's curl embeds
    assert "http://127.0.0.1:8000/v1/embeddings" in msg and json.loads(msg.split("-d '", 1)[1].rstrip("'"))["input"]
    msg = ready_message("0.0.0.0", 8000, "smol", api_key=None, pooling="classify")  # a classifier's classifies
    assert "http://127.0.0.1:8000/classify" in msg and json.loads(msg.split("-d '", 1)[1].rstrip("'"))["input"]
    msg = ready_message("0.0.0.0", 8000, "smol", api_key=None, pooling="token_classify")  # a tagger's: /pooling
    assert "http://127.0.0.1:8000/pooling" in msg and json.loads(msg.split("-d '", 1)[1].rstrip("'"))["input"]


def test_the_key_defaults_to_kvserves_variable_then_vllms(monkeypatch):
    """A deployment moved from `vllm serve` that keeps its key in $VLLM_API_KEY is not served open."""
    def key():
        return build_parser().parse_args(["serve"]).api_key

    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert key() == "from-vllm"
    monkeypatch.setenv("KVSERVE_API_KEY", "from-kvserve")
    assert key() == "from-kvserve"
    assert build_parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_serve_rejects_bad_flags_in_one_line_before_starting_ray():
    r = kvserve("serve", "--max-num-seqs", "0")
    assert r.returncode == 2 and r.stderr.startswith("kvserve: error: max_num_seqs must be >= 1")
    r = kvserve("serve", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = kvserve("serve", "-tp", "2")  # SmolLM2's 9 attention heads do not split in two
    assert r.returncode == 2 and "cannot split this model across tensor_parallel_size=2" in r.stderr
    for flags, says in [(["--port", "99999"], "invalid port '99999' (1-65535)"), (["--port", "0"], "invalid port"),
                        (["--api-key", ""], "argument --api-key: empty key"),
                        (["--bogus"], "unrecognized arguments: --bogus (see 'kvserve serve --help')"),
                        (["--max-num-seq", "8"], "unrecognized arguments: --max-num-seq"),  # no abbreviations
                        (["--chat-template", "/nonexistent.jinja"], "no such file, nor a Jinja template"),
                        (["--chat-template", "{% for m in messages %"], "not a valid Jinja template"),
                        (["/nonexistent/model"], "model path '/nonexistent/model' does not exist"),  # vLLM's MODEL
                        (["/m", "--model", "/n"], "the model is given twice: /m and --model /n"),
                        (["--tool-call-parser", "granite"], "invalid choice: 'granite' (choose from 'hermes', 'llama3_json', "
                                                              "'mistral', 'pythonic', 'llama4_pythonic')"),
                        (["--reasoning-parser", "granite"], "invalid choice: 'granite' (choose from 'deepseek_r1', "
                                                            "'qwen3')"),
                        (["--override-generation-config", '{"temperature": -1}'],
                         "temperature: Input should be greater than or equal to 0"),
                        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "256", "--max-model-len", "1024"],
                         "without chunked prefill max_num_batched_tokens (256) must be >= max_model_len (1024)")]:
        r = kvserve("serve", *flags)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
    r = kvserve("serve", "--max-model-len", "100000")  # refused, as vLLM does, not clamped to 8192
    assert r.returncode == 2 and "max_model_len 100000 is more than the model's 8192 positions" in r.stderr


def test_serve_reports_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = str(s.getsockname()[1])
        r = kvserve("serve", "--port", busy)
        assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr
        r = kvserve("serve", "--port", str(free_port()), "--metrics-export-port", busy)  # Ray's agent would hang on it
        assert r.returncode == 2 and f"cannot listen on 0.0.0.0:{busy} (--metrics-export-port)" in r.stderr


def test_serve_says_at_once_that_no_ray_cluster_answers():
    """Ray itself retries an absent cluster for over a minute before its own error."""
    import grpc

    from cluster.serve_cli import _ray_unreachable

    port = free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        start = time.monotonic()
        r = kvserve("serve", "--ray-address", address)
        assert r.returncode == 1 and f"no Ray cluster answers at {address}: Connection refused" in r.stderr
        assert time.monotonic() - start < 30 and "Traceback" not in r.stderr
    assert _ray_unreachable("auto") is None and _ray_unreachable("local") is None
    assert _ray_unreachable("nohost.invalid").startswith("no Ray cluster")
    with socket.socket() as listener:  # something that listens and never answers (an HTTP server is the same)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        why = _ray_unreachable(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0)
        assert why.endswith("it is not a Ray cluster (it does not speak gRPC)")
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))  # Ray's GCS and client server are gRPC servers
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert _ray_unreachable(f"127.0.0.1:{port}") is None and _ray_unreachable(f"ray://127.0.0.1:{port}") is None
    finally:
        server.stop(None)


def test_the_fake_engine_meets_the_engine_contract():
    from engine.protocol import EngineClient
    from tests.fake_engine import FakeEngine

    fake = FakeEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert isinstance(fake, EngineClient) and fake.max_model_len == 64
    assert fake.routing_snapshot().num_total_blocks == 8


@pytest.mark.parametrize("path, body, says", [
    ("/v1/completions", b'{"prompt": "abc\\ud800def"}', "lone UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "lone UTF-16 surrogate"),
    ("/tokenize", b'{"prompt": "abc\\ud800def"}', "lone UTF-16 surrogate"),
    ("/v1/completions", b"[" * 10000 + b"]" * 10000, "nested deeper than"),
    ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 200 + b"]" * 200 + b"}", "nested deeper than"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON number"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', "out of range"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("/v1/completions", b"\xff\xfe", "not valid JSON"),
])
def test_hostile_bodies_get_a_400_that_says_why(tokenizer, path, body, says):
    r = call(tokenizer, "POST", path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "invalid_json"


def test_json_in_a_string_nested_past_pythons_stack_is_no_500(tokenizer):
    """A string field is not held to the body's depth limit: a schema nested past Python's stack
    is a 400 naming it; tool-call arguments in the history pass to the template as their text."""
    deep = "[" * 5000 + "]" * 5000
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": "hi", "structured_outputs": {"json": deep}})
    assert r.status_code == 400 and "structured_outputs.json nests too deeply" in r.json()["error"]["message"]
    call_ = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + deep + "}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call_]},
               {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    r = call(tokenizer, "POST", "/tokenize", json={"messages": history})
    assert r.status_code == 200 and r.json()["count"] > 5000, r.text  # the arguments' text, rendered
    r = call(tokenizer, "POST", "/v1/chat/completions", json={"messages": history, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text  # 64 tokens here


def test_an_empty_model_name_is_the_served_model(tokenizer):
    """As vLLM reads it ("model": "" is no model named)."""
    r = call(tokenizer, "POST", "/v1/completions", json={"model": "", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "m", r.text


def test_an_error_quotes_a_huge_value_briefly(tokenizer):
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": "hi", "bad_words": ["word"] * 50000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    message = r.json()["error"]["message"]
    assert len(message) < 400 and message.endswith("... (50000 items)"), message


def test_a_surrogate_pair_is_text_and_is_served(tokenizer):
    r = call(tokenizer, "POST", "/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}',
             headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_a_negative_token_id_is_named_as_such(tokenizer):
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": [1, -1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
    assert "greater than or equal to 0" in r.json()["error"]["message"]


def test_a_union_members_error_is_named_by_its_fields_only(tokenizer):
    r = call(tokenizer, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name", r.text


@pytest.mark.parametrize("origins", [(), ("https://app.example",)])
def test_cors_answers_browsers_only_from_the_allowed_origins(tokenizer, origins):
    """vLLM's --allowed-origins (none by default here): a preflight from an allowed origin is
    answered without the API key; the reply then names the origin."""
    settings = RouterSettings(served_model_name="m", api_key="k", allowed_origins=origins)
    engine = EngineServer(EngineConfig(max_model_len=64, max_num_seqs=4), "tests.fake_engine:FakeEngine")
    app = build_api(OpenAIServing(tokenizer, engine, settings))
    origin = {"Origin": "https://app.example"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            preflight = await c.options("/v1/chat/completions", headers={
                **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
            models = await c.get("/v1/models", headers={**origin, "Authorization": "Bearer k"})
            return preflight, models

    preflight, models = asyncio.run(go())
    assert models.status_code == 200
    if origins:
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == models.headers["access-control-allow-origin"] \
            == "https://app.example"
    else:
        assert preflight.status_code != 200 and "access-control-allow-origin" not in models.headers


def test_prompts_times_n_per_request_is_capped(tokenizer):
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": ["hi"] * 300, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "300 prompts x n=1 = 300 sequences" in r.json()["error"]["message"]
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": ["hi"] * 100, "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]
    # n alone: up to vLLM's 16,384 as a field, this server's limit as a request (the 400 names n)
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):
        r = call(tokenizer, "POST", path, json={**body, "n": 300, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "1 prompts x n=300" in r.json()["error"]["message"]


def test_openapi_document_and_docs_page_are_served_without_a_key(tokenizer):
    r = call(tokenizer, "GET", "/openapi.json", api_key="k")
    assert r.status_code == 200
    doc = r.json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["properties"]["n"]["maximum"] == 16384
    assert {"/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health"} <= set(doc["paths"])
    refs = {m.group(1) for m in __import__("re").finditer(r'"#/components/schemas/(\w+)"', r.text)}
    assert refs <= set(doc["components"]["schemas"])  # every reference resolves
    page = call(tokenizer, "GET", "/docs", api_key="k")
    assert page.status_code == 200 and "/openapi.json" in page.text


def test_a_draining_app_refuses_new_requests_but_stays_alive(tokenizer):
    from router.api import Admission

    admission = Admission(retry_after_s=2)
    settings = RouterSettings(served_model_name="m")
    engine = EngineServer(EngineConfig(max_model_len=64, num_gpu_blocks_override=64), "tests.fake_engine:FakeEngine")
    app = build_api(OpenAIServing(tokenizer, engine, settings), admission=admission)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            before = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert admission.drain() == 0  # nothing in flight: the request above has ended
            return (before, await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                    await c.get("/ready"), await c.get("/health"))

    before, after, ready, health = asyncio.run(go())
    assert before.status_code == 200 and after.status_code == 503
    assert after.headers["Retry-After"] == "2" and after.json()["error"]["code"] == "unavailable"
    assert ready.status_code == 503 and health.status_code == 200


def test_a_model_is_retrieved_by_its_name_and_another_is_a_404(tokenizer):
    r = call(tokenizer, "GET", "/v1/models/m")
    assert r.status_code == 200 and r.json()["id"] == "m" and r.json()["object"] == "model"
    assert r.json() == call(tokenizer, "GET", "/v1/models").json()["data"][0]
    r = call(tokenizer, "GET", "/v1/models/org/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- the event loop stays free while a large request is prepared ----------------------------------

@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"model": "m", "prompt": "hello world, " * 200_000}),  # 2.6 MB of text to tokenize
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": ""}] * 100_000,
                              "max_tokens": 1}),  # 100k messages to parse, validate and render
])
def test_other_clients_are_answered_while_a_large_request_is_prepared(tokenizer, path, body):
    """Parsing, the chat template and tokenizing run on router.off_loop's thread: on the event loop,
    a request like these held every other client, /health included, for the seconds it took."""
    from tests.scripted_engine import run

    async def go(client):
        http = client._client
        hostile = asyncio.create_task(http.post(path, json=body, timeout=120))
        await asyncio.sleep(0.05)
        answered = 0
        while not hostile.done():
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 200
            answered += 1
            await asyncio.sleep(0.01)
        return answered, (await hostile).status_code

    (answered, status), _ = run(tokenizer, "x", go, settings={"max_request_body_bytes": 8 << 20})
    assert status in (200, 400)  # the chat's prompt is longer than the model: refused once rendered
    assert answered >= 5, answered  # on the loop: none until it was done


def test_a_body_that_does_not_arrive_in_time_is_408_and_frees_its_seat(tokenizer, monkeypatch):
    """A client that sends its headers and trickles the body held an ingress seat for as long as it
    liked (~4k of them took every seat, /health's too); the body now has BODY_READ_TIMEOUT_S."""
    import router.api
    from tests.scripted_engine import run

    monkeypatch.setattr(router.api, "BODY_READ_TIMEOUT_S", 0.3)

    async def trickle():
        yield b'{"model": "m", '
        await asyncio.sleep(5)
        yield b'"prompt": "x"}'

    async def go(client):
        http = client._client
        start = time.monotonic()
        slow = await http.post("/v1/completions", content=trickle(), headers={"Content-Type": "application/json"})
        waited = time.monotonic() - start
        ok = await http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        return slow, waited, ok.status_code

    (slow, waited, ok), _ = run(tokenizer, "x", go)
    assert slow.status_code == 408 and slow.json()["error"]["code"] == "request_timeout", slow.text
    assert "did not arrive within 0.3 s" in slow.json()["error"]["message"] and waited < 3
    assert ok == 200


def test_chat_template_kwargs_may_set_none_of_apply_chat_templates_own_arguments():
    """A request's (and --default-chat-template-kwargs') variables go to apply_chat_template as
    keywords: every argument of the installed transformers' own is refused by name, not by the
    call failing on a duplicate."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from router.protocol import TEMPLATE_ARGUMENTS

    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
    assert own <= TEMPLATE_ARGUMENTS, sorted(own - TEMPLATE_ARGUMENTS)


def test_logprobs_json_cannot_hold_are_written_as_vllm_writes_minus_infinity():
    """-inf is -9999.0, as vLLM writes it; NaN (an adapter or checkpoint whose weights make NaN
    logits) too, so the reply is JSON a client can read, not a 500."""
    import json
    import math

    from router.formatting import completion_logprobs

    nan, inf = float("nan"), float("inf")
    out = completion_logprobs([1, 2], [{1: nan, 2: -inf}, {2: -0.5, 3: inf}], 1, str)
    assert out["token_logprobs"] == [-9999.0, -0.5] and out["top_logprobs"][1] == {"3": 9999.0, "2": -0.5}
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in json.loads(json.dumps(out))["token_logprobs"])
    json.dumps(out, allow_nan=False)  # what a JSON response refuses


def test_the_developer_role_renders_as_system_where_the_template_does_not_know_it(tokenizer):
    dev = call(tokenizer, "POST", "/tokenize", json={"messages": [{"role": "developer", "content": "Be terse."},
                                                                  {"role": "user", "content": "hi"}]})
    sys_ = call(tokenizer, "POST", "/tokenize", json={"messages": [{"role": "system", "content": "Be terse."},
                                                                   {"role": "user", "content": "hi"}]})
    assert dev.status_code == 200 and dev.json()["tokens"] == sys_.json()["tokens"], dev.text


def test_a_max_tokens_past_the_context_is_cut_to_the_room_the_prompt_leaves(tokenizer):
    """vLLM's reading (get_max_tokens): prompt + max_tokens over max_model_len (64 here) runs to the
    end of the context, finish_reason length; max_tokens alone over it is a 400. Each prompt of a
    batch gets its own room."""
    prompts = ["hi", "a much longer prompt that takes a good many more tokens than the first one does"]
    lens = [len(tokenizer.encode(p)) for p in prompts]
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": prompts, "max_tokens": 64, "min_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert [len(c["text"].split()) for c in body["choices"]] == [64 - n for n in lens]
    assert body["usage"]["completion_tokens"] == 128 - sum(lens)
    r = call(tokenizer, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_completion_tokens": 60, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    usage = events(r)[-1]["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    r = call(tokenizer, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
