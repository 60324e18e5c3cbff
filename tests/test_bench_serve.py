"""benchmarks/serve.py's reading of kvserve's engine step counters from Ray's Prometheus text, and
benchmarks/paced_engine.py's outputs."""
import asyncio

import pytest

from benchmarks import serve

EXPORT = """# HELP ray_kvserve_engine_steps_total Engine steps, by kind
# TYPE ray_kvserve_engine_steps_total counter
ray_kvserve_engine_steps_total{application="kvserve",deployment="EngineServer",kind="decode",model_name="bench",replica="a"} 100.0
ray_kvserve_engine_steps_total{application="kvserve",deployment="EngineServer",kind="decode",model_name="bench",replica="b"} 20.0
ray_kvserve_engine_steps_total{application="kvserve",deployment="EngineServer",kind="prefill",model_name="bench",replica="a"} 4.0
ray_kvserve_engine_step_seconds_total{application="kvserve",deployment="EngineServer",kind="decode",model_name="bench",replica="a"} 5.0
ray_kvserve_engine_step_seconds_total{application="kvserve",deployment="EngineServer",kind="decode",model_name="bench",replica="b"} 1.0
ray_kvserve_engine_step_seconds_total{application="kvserve",deployment="EngineServer",kind="prefill",model_name="bench",replica="a"} 8.0
ray_kvserve_num_preemptions_total{application="kvserve",model_name="bench",replica="a"} 3.0
"""


def test_step_counters_are_summed_over_replicas_and_differenced_into_mean_step_times(monkeypatch):
    class Response:
        text = EXPORT

    monkeypatch.setattr(serve.httpx, "get", lambda url, timeout: Response())
    after = serve.engine_steps(9999)
    assert after == {("steps", "decode"): 120.0, ("steps", "prefill"): 4.0,
                     ("step_seconds", "decode"): 6.0, ("step_seconds", "prefill"): 8.0}
    before = {("steps", "decode"): 20.0, ("step_seconds", "decode"): 1.0, ("steps", "prefill"): 4.0,
              ("step_seconds", "prefill"): 8.0}
    assert serve.step_ms(before, after) == {"decode": 50.0}  # no prefill step in between: no prefill figure
    assert serve.step_ms(None, after) == {} and serve.engine_steps(None) is None


def test_the_paced_engine_hands_out_outputs_as_the_engine_does(monkeypatch):
    from benchmarks.paced_engine import PacedEngine
    from engine.config import EngineConfig
    from engine.sampling_params import RequestOutputKind, SamplingParams

    monkeypatch.setenv("KVSERVE_PACED_STEP_S", "0.001")

    async def outputs(kind):
        engine = PacedEngine(EngineConfig())
        try:
            return [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=5, output_kind=kind))]
        finally:
            await engine.shutdown()

    delta, final = asyncio.run(outputs(RequestOutputKind.DELTA)), asyncio.run(outputs(RequestOutputKind.FINAL_ONLY))
    assert [o.outputs[0].delta_token_ids for o in delta] == [[5], [6], [7], [5], [6]]
    assert [o.outputs[0].delta_token_ids for o in final] == [[5], [6, 7, 5, 6]]  # the first, then the rest
    assert [o.finished for o in final] == [False, True] and final[1].outputs[0].finish_reason == "length"


def test_lora_rank_launches_both_servers_with_one_adapter_that_kvserve_accepts(tmp_path, monkeypatch, smollm2_path):
    """--lora-rank: the same vLLM flags for kvserve and vLLM, naming one random adapter in PEFT's
    format that kvserve's start-up check takes."""
    from cluster.cli import build_parser
    from engine.lora_request import lora_modules

    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    args = serve.parse_args(["--launch", "kvserve", "vllm", "--lora-rank", "8"])
    kvserve = serve.launch_command("kvserve", 8000, smollm2_path, args)
    vllm = serve.launch_command("vllm", 8001, smollm2_path, args)
    flags = serve.lora_flags(smollm2_path, args)
    assert flags[:4] == ["--enable-lora", "--max-lora-rank", "16", "--lora-modules"]
    assert kvserve[-len(flags):] == flags and vllm[-len(flags):] == flags
    parsed = build_parser().parse_args(kvserve[kvserve.index("serve"):])
    assert parsed.enable_lora and lora_modules(parsed.lora_modules, parsed.max_lora_rank)[0].lora_name == "bench-lora"
    plain = serve.parse_args(["--launch", "kvserve"])
    assert plain.lora_rank == 0 and serve.lora_flags(smollm2_path, plain) == []


def test_offline_benchmarks_shortest_lengths_default_within_the_longest():
    """benchmarks/offline.py's docstring example: --max-output 8 alone is taken (--min-output
    defaults to 32, or to the longest when that is less); a preset's own lengths stand."""
    from benchmarks.offline import parse_args

    args = parse_args(["--num-prompts", "4", "--max-output", "8", "--max-input", "16"])
    assert (args.min_output, args.max_output, args.min_input, args.max_input) == (8, 8, 16, 16)
    assert (parse_args([]).min_output, parse_args([]).min_input) == (32, 32)
    assert parse_args(["--preset", "nano-vllm"]).min_output == 100
    with pytest.raises(SystemExit):
        parse_args(["--min-output", "9", "--max-output", "8"])
