"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion under continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):  # only the finished outputs are kept
            self.engine.add_request(rid, prompt, dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts)) if use_tqdm else None
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[rid] for rid in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one prompt's first completion as they are generated."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.outputs[0].delta_text:
                            yield out.outputs[0].delta_text
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
