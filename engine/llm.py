"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`, `.chat(messages)`
and `.beam_search(prompts, BeamSearchParams(...))`."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, search, sequences
from engine.chat_format import as_parts, developer_as_system, resolved
from engine.config import EngineConfig
from engine.generation_config import sampling_defaults
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.metric_sinks import Metric
from engine.model_source import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, model_dir
from engine.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                            Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                            ScoringRequestOutput, StepOutput)
from engine.pooling import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scoring import pair_length, pair_prompts, pair_scores, score_pairs, templated_prompts
from engine.inputs import unwrapped_prompt
from engine.vllm_args import without_vllm_only

# Text, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": text}, {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **engine_kwargs) -> None:
        """`engine_kwargs`: EngineConfig's fields, and vLLM's with nothing to set here
        (engine.vllm_args: `swap_space`, `tokenizer_mode="auto"`, `quantization=None`, ...).
        `disable_log_stats=False` records vLLM's metrics for `get_metrics()` (True, the default
        offline as in vLLM, records none). A keyword given as None takes its default, as vLLM's
        (a script passes its optional arguments on as they are).
        `generation_config` (auto: the model's generation_config.json, vllm: none, or a folder) and
        `override_generation_config`: the sampling fields of `get_default_sampling_params`, which a
        call given no SamplingParams runs with (engine.generation_config)."""
        log_stats = engine_kwargs.pop("disable_log_stats", None) is False
        served = engine_kwargs.pop("served_model_name", None)  # vLLM's: the metrics' model_name
        engine_kwargs.pop("use_tqdm_on_load", None)  # the weights load with log lines, no bar to turn off
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
        config = EngineConfig(model=model, **without_vllm_only(engine_kwargs))
        # before the engine loads anything: a bad generation config costs no model load
        self.sampling_defaults = sampling_defaults(generation_config or "auto", model_dir(config),
                                                   override_generation_config)
        self.engine = LLMEngine(config)
        if log_stats:
            # labelled with the model as given, as vLLM's (the embedded one by its name), or its
            # served_model_name (the first of a list)
            if isinstance(served, (list, tuple)):
                served = served[0] if served else None
            self.engine.enable_metrics(served or (DEFAULT_MODEL_NAME if model in DEFAULT_MODEL_ALIASES else str(model)))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for `engine`."""
        return self.engine

    def get_tokenizer(self):
        """vLLM's name for `tokenizer`."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The params of a call given none: the generation config's sampling fields, else vLLM's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None, priority: int | list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Run every prompt (text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}
        dicts, with an optional cache_salt) to completion under continuous batching; outputs in
        prompt order. An n above max_num_seqs is served in several engine calls, the samples those
        one call gives. `priority`: one per prompt (or one for all), under scheduling_policy="priority"
        (vLLM's). `tokenization_kwargs`: how a text prompt is tokenized, vLLM's `truncation` with
        `max_length` (its first tokens kept) and `add_special_tokens`.
        A max_tokens that would run past max_model_len ends that prompt's outputs "length" there
        (vLLM's); a prompt that leaves no room is refused. `use_tqdm`: a progress bar, or the tqdm
        class to make it with. `lora_request`: a LoRARequest (engine.lora_request) for every prompt,
        or a list of one (or None) per prompt, with enable_lora."""
        tokenize = _tokenizer_call(self.tokenizer, tokenization_kwargs)
        prompts = _listed(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
            params = [dataclasses.replace(p, priority=k) for p, k in zip(params, priority)]
        prompts, salts = zip(*map(unwrapped_prompt, prompts)) if prompts else ((), ())
        texts = list(prompts)  # as given, for the outputs' `prompt` where tokenize cut them here
        if tokenize is not None:
            prompts = [tokenize(p) if isinstance(p, str) else p for p in prompts]
        params = [p if salt is None else dataclasses.replace(p, cache_salt=salt) for p, salt in zip(params, salts)]
        params = _with_lora(params, lora_request)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        # A prompt's n samples in calls that fit max_num_seqs (SamplingParams.split): parts[rid]
        # holds (the part's request id, its first sample's index) for each.
        parts: dict[str, list[tuple[str, int]]] = {}
        left: dict[str, str] = {}  # part id -> its prompt's id, until it finishes
        try:
            for rid, prompt, p in zip(ids, prompts, params):  # only the finished outputs are kept
                calls = p.split(self.engine.config.max_num_seqs)
                parts[rid] = [(rid if len(calls) == 1 else f"{rid}.{k}", first) for k, (first, _) in enumerate(calls)]
                for (part_id, _), (_, q) in zip(parts[rid], calls):
                    foreign = part_id in self.engine.requests
                    try:
                        self.engine.add_request(part_id, prompt,
                                                dataclasses.replace(q, output_kind=RequestOutputKind.FINAL_ONLY),
                                                fit_model_len=True)
                    finally:  # a Ctrl-C landing after the engine took it: it is ours to abort
                        if not foreign and part_id in self.engine.requests:
                            left[part_id] = rid
        except BaseException:  # a bad prompt or params, Ctrl-C: none of the batch runs (as vLLM's LLM)
            for part_id in left:
                self.engine.abort(part_id, refused=True)
            raise
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts), use_tqdm)
        try:
            while left:
                for out in self.engine.step():
                    if out.finished and out.request_id in left:  # not a request of the engine's caller
                        done[out.request_id] = out
                        rid = left.pop(out.request_id)
                        if bar and all(part_id in done for part_id, _ in parts[rid]):
                            bar.update(1)
        finally:
            for part_id in left:  # interrupted (Ctrl-C, a step that failed): none of them runs on
                self.engine.abort(part_id)
            if bar:
                bar.close()
        outs = [_Logprobs(self.tokenizer, p.detokenize).request_output(
            _joined(rid, [(done[part_id], first) for part_id, first in parts[rid]]), p) for rid, p in zip(ids, params)]
        if tokenize is None:
            return outs
        return [dataclasses.replace(o, prompt=t) if isinstance(t, str) else o for o, t in zip(outs, texts)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
             priority: int | list[int] | None = None, tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """`generate` for one conversation or a list of them (OpenAI-style messages), each rendered
        by the model's chat template (or `chat_template`) as vLLM's `LLM.chat` and the server's
        /v1/chat/completions render it: the template's text, tokenized without adding special
        tokens (the template writes its own). `prompt` in each output is that text.
        `chat_template_kwargs` go to the template, over the arguments named here (vLLM's order).
        `chat_template_content_format`: "string" gives a message's text parts joined by newlines,
        "openai" the parts as a list; "auto" the latter for a template that loops over a message's
        content (vLLM's detection). `lora_request`, `priority`: as `generate`'s; `tokenization_kwargs`
        too, over the rendered text (tokenized without special tokens unless they say otherwise)."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: the engine serves text models")
        template_kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools)
        template_kwargs.update(chat_template_kwargs or {})
        if template_kwargs["continue_final_message"] and template_kwargs["add_generation_prompt"]:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if not (template_kwargs["chat_template"] or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a text prompt")
        template = template_kwargs["chat_template"] or self.tokenizer.chat_template
        content = _as_parts if resolved(chat_template_content_format, template) == "openai" else _flat
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template([content(m) for m in developer_as_system(conversation, template)],
                                                    tokenize=False, **template_kwargs)
                 for conversation in conversations]
        tokenize = _tokenizer_call(self.tokenizer, {"add_special_tokens": False, **(tokenization_kwargs or {})})
        outs = self.generate([tokenize(text) for text in texts], sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request, priority=priority)
        return [dataclasses.replace(out, prompt=text) for out, text in zip(outs, texts)]

    def encode(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
               *, use_tqdm: bool | Callable = True, lora_request=None, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None,
               tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """vLLM's: each prompt's pooled vector (a torch tensor), from an engine started with
        runner="pooling" (engine.pooling); in prompt order, run under continuous batching as
        `generate` runs its prompts. `pooling_task` (embed, token_embed, classify, score,
        token_classify) is the task of every prompt, whatever its params say; without one, the
        params' (embed without params). `truncate_prompt_tokens` applies to every prompt whose
        params leave it unset."""
        import torch

        params = PoolingParams() if pooling_params is None else pooling_params
        if pooling_task is not None:
            params = ([dataclasses.replace(p, task=pooling_task) for p in params] if isinstance(params, list)
                      else dataclasses.replace(params, task=pooling_task))
        outs = self._pooled(prompts, params, use_tqdm, lora_request, truncate_prompt_tokens, tokenization_kwargs)
        return [PoolingRequestOutput(out.request_id, PoolingOutput(torch.tensor(out.pooled)), out.prompt_token_ids,
                                     out.num_cached_tokens) for out in outs]

    def embed(self, prompts: Prompt | list[Prompt], *, use_tqdm: bool | Callable = True,
              pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request=None,
              truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (`outputs.embedding`, a list of floats), as `encode`'s."""
        outs = self._pooled(prompts, PoolingParams() if pooling_params is None else pooling_params, use_tqdm,
                            lora_request, truncate_prompt_tokens, tokenization_kwargs)
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled), out.prompt_token_ids,
                                       out.num_cached_tokens) for out in outs]

    def classify(self, prompts: Prompt | list[Prompt], *, use_tqdm: bool | Callable = True,
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request=None,
                 tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (`outputs.probs`), from a sequence classifier
        (engine.classifier) started with runner="pooling"."""
        params = ([dataclasses.replace(p, task="classify") for p in pooling_params] if isinstance(pooling_params, list)
                  else dataclasses.replace(pooling_params or PoolingParams(), task="classify"))
        outs = self._pooled(prompts, params, use_tqdm, lora_request, None, tokenization_kwargs)
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(out.pooled), out.prompt_token_ids,
                                            out.num_cached_tokens) for out in outs]

    def score(self, data_1: Prompt | list[Prompt], data_2: Prompt | list[Prompt], /, *,
              use_tqdm: bool | Callable = True, pooling_params: PoolingParams | None = None, lora_request=None,
              truncate_prompt_tokens: int | None = None, tokenization_kwargs: dict | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's, pairing one `data_1` with every `data_2`, or the i-th with the i-th
        (engine.scoring). An embedding model: the cosine similarity of each pair's embeddings,
        every input embedded once. A cross-encoder (a classifier with one label): its score for
        each pair, read as one prompt: the tokenizer's pair encoding, or the pair rendered by
        `chat_template` (a score template: engine.scoring.templated_prompts). Either way in one
        continuous batch."""
        firsts, seconds = list(_listed(data_1)), list(_listed(data_2))
        pairs = score_pairs(len(firsts), len(seconds))
        head = None if self.engine.pooler is None else self.engine.pooler.classifier
        if chat_template is not None and head is None:
            raise ValueError("chat_template (a score template) is for a cross-encoder: an embedding model embeds "
                             "each text on its own")
        if head is not None:
            texts = [_text(t) for t in firsts + seconds]
            firsts, seconds = texts[:len(firsts)], texts[len(firsts):]
            params = pooling_params or PoolingParams()
            keep = truncate_prompt_tokens if truncate_prompt_tokens is not None else params.truncate_prompt_tokens
            both = [(firsts[i], seconds[j]) for i, j in pairs]
            if chat_template is None:
                prompts, starts = pair_prompts(self.tokenizer, both, head.use_pad_token,
                                               pair_length(keep, self.engine.max_model_len))
                params = dataclasses.replace(params, truncate_prompt_tokens=None)  # cut as a pair, above
            else:  # one text each, cut as any prompt is
                prompts, starts = templated_prompts(self.tokenizer, both, chat_template), [None] * len(both)
                params = dataclasses.replace(params, truncate_prompt_tokens=keep)
            params = dataclasses.replace(params, task="score")
            outs = self._pooled([{"prompt_token_ids": p} for p in prompts],
                                [dataclasses.replace(params, token_type_start=s) for s in starts], use_tqdm,
                                lora_request, None, tokenization_kwargs)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.pooled[0]), o.prompt_token_ids,
                                         o.num_cached_tokens) for o in outs]
        outs = self._pooled(firsts + seconds, PoolingParams() if pooling_params is None else pooling_params,
                            use_tqdm, lora_request, truncate_prompt_tokens, tokenization_kwargs)
        a, b = outs[:len(firsts)], outs[len(firsts):]
        scores = pair_scores([o.pooled for o in a], [o.pooled for o in b])
        return [ScoringRequestOutput(f"{a[i].request_id}_{b[j].request_id}", ScoringOutput(score),
                                     a[i].prompt_token_ids + b[j].prompt_token_ids,
                                     a[i].num_cached_tokens + b[j].num_cached_tokens)
                for (i, j), score in zip(pairs, scores)]

    def _pooled(self, prompts: Prompt | list[Prompt], params: PoolingParams | list[PoolingParams], use_tqdm,
                lora_request, truncate_prompt_tokens: int | None, tokenization_kwargs) -> list[RequestOutput]:
        """`encode`'s and `embed`'s run: the prompts' outputs, each with its vector (`pooled`)."""
        listed = params if isinstance(params, list) else [params] * len(_listed(prompts))
        if truncate_prompt_tokens is not None:
            listed = [p if p.truncate_prompt_tokens is not None else
                      dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in listed]
        return self.generate(prompts, [p.sampling() for p in listed], use_tqdm=use_tqdm, lora_request=lora_request,
                             tokenization_kwargs=tokenization_kwargs)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool | Callable = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's `beam_width` best beams, best first, by the
        search the server's `use_beam_search` runs (engine.beam_search). The prompts' searches
        run together, each round's beams batched by the engine; `concurrency_limit` of them at
        most. A beam that drew an end token keeps it, in its tokens and its text (vLLM's offline
        search); max_tokens is cut to what max_model_len leaves after the prompt. `lora_request`:
        one LoRARequest for every prompt, or one per prompt, as `generate` takes it."""
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        cap = self.engine.config.max_logprobs
        if cap != -1 and params.beam_width > cap // 2:  # each round asks 2 x beam_width logprobs per beam
            raise ValueError(f"beam_width must be at most {cap // 2} (half the engine's max_logprobs, {cap}), "
                             f"got {params.beam_width}")
        prompts = _listed(prompts)
        asked = []
        loras = [p.lora_request for p in _with_lora([SamplingParams()] * len(prompts), lora_request)]
        for prompt, lora in zip(prompts, loras):
            prompt, salt = unwrapped_prompt(prompt)
            ids = self.engine.tokenize(prompt)[1]
            sampling = SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, cache_salt=salt,
                                      lora_request=lora)
            fitted = self.engine.validate(ids, sampling, fit_model_len=True)  # before any round runs
            asked.append((ids, dataclasses.replace(sampling, max_tokens=fitted)))
        beam = BeamSearch(params.beam_width, params.length_penalty, include_stop_str_in_output=True)
        eos = set(self.engine.eos_token_ids)
        logprobs = _Logprobs(self.tokenizer)
        bar = _progress(len(asked), use_tqdm)

        async def one(calls: _EngineCalls, ids: list[int], p: SamplingParams, seats: asyncio.Semaphore | None,
                      ) -> BeamSearchOutput:
            async with seats or contextlib.nullcontext():
                _, best = await search(calls.generate, f"beam-{next(self._ids)}", ids, p, beam, eos)
            if bar:
                bar.update(1)
            out = sequences(ids, best, beam, functools.partial(self.tokenizer.decode,
                                                               skip_special_tokens=params.skip_special_tokens))
            return BeamSearchOutput([logprobs.beam(q, len(ids)) for q in out.sequences])

        async def run() -> list[BeamSearchOutput]:
            calls = _EngineCalls(self.engine)
            seats = None if concurrency_limit is None else asyncio.Semaphore(concurrency_limit)
            stepping = asyncio.create_task(calls.run())
            try:
                return await asyncio.gather(*[one(calls, ids, p, seats) for ids, p in asked])
            finally:
                stepping.cancel()

        try:
            return asyncio.run(run())
        finally:
            if bar:
                bar.close()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's metrics (LLM(..., disable_log_stats=False)); the
        types and names are engine.metric_sinks'."""
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: empty the prefix cache (after the weights changed, its KV is stale); False while
        requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one prompt's first completion as they are generated (the params as `generate`'s)."""
        rid = f"stream-{next(self._ids)}"
        params = sampling_params or self.get_default_sampling_params()
        self.engine.add_request(rid, prompt, params, fit_model_len=True)  # it unwraps a prompt dict
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


class _EngineCalls:
    """engine.beam_search's `generate` over the LLM's own engine: each call a request whose one
    finished output is its reply, every call in flight stepped together by `run`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.waiting: dict[str, asyncio.Future] = {}
        self.wake = asyncio.Event()

    async def generate(self, request_id: str, ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        self.engine.add_request(request_id, ids, params)
        self.waiting[request_id] = done = asyncio.get_running_loop().create_future()
        self.wake.set()
        try:
            out: RequestOutput = await done
        finally:
            if self.waiting.pop(request_id, None) is not None:  # cancelled: another call failed
                self.engine.abort(request_id)
        yield StepOutput.from_request_output(out, set(), first=True)

    async def run(self) -> None:
        try:
            while True:
                if not self.waiting:
                    self.wake.clear()
                    await self.wake.wait()
                for out in self.engine.step():
                    if out.finished and (done := self.waiting.pop(out.request_id, None)) is not None:
                        done.set_result(out)
                await asyncio.sleep(0)  # the calls answered send their next round
        except Exception as e:  # the engine failed: so does every call waiting on it
            for done in self.waiting.values():
                if not done.done():
                    done.set_exception(e)
            raise


def _flat(message: dict) -> dict:
    """An OpenAI message whose content is a list of parts, with its text parts joined by newlines
    (as the server's chat joins them, and vLLM's for string templates)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(_texts(content))}


def _as_parts(message: dict) -> dict:
    """An OpenAI message with its content as a list of text parts (vLLM's "openai" content format)."""
    if isinstance(message.get("content"), list):
        _texts(message["content"])
    return as_parts(message)


def _texts(parts: list) -> list[str]:
    if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
        raise ValueError("only text content parts are supported: the engine serves text models")
    return [p["text"] for p in parts]


def _with_lora(params: list[SamplingParams], lora_request) -> list[SamplingParams]:
    """Each prompt's params with its adapter: `lora_request` one LoRARequest for all, or a list
    of one (or None) per prompt, as vLLM's LLM takes it."""
    if lora_request is None:
        return params
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(params)
    if len(loras) != len(params):
        raise ValueError(f"{len(loras)} lora requests for {len(params)} prompts")
    if any(lora is not None and not isinstance(lora, LoRARequest) for lora in loras):
        raise TypeError("lora_request must be a LoRARequest (engine.lora_request), a list of them, or None")
    return [p if lora is None else dataclasses.replace(p, lora_request=lora) for p, lora in zip(params, loras)]


def _listed(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt or a list of them -> a list. A tokenizer's output (transformers' BatchEncoding, what
    `tokenizer(texts)` and `apply_chat_template(..., tokenize=True)` return) gives its token ids,
    less any padding its attention_mask marks."""
    if isinstance(prompts, Mapping) and not isinstance(prompts, dict) and "input_ids" in prompts:
        rows = _as_lists(prompts["input_ids"])
        masks = _as_lists(prompts["attention_mask"]) if "attention_mask" in prompts else None
        if rows and isinstance(rows[0], int):
            rows, masks = [rows], None if masks is None else [masks]
        if masks is not None:
            rows = [[t for t, keep in zip(row, mask) if keep] for row, mask in zip(rows, masks)]
        return rows
    return [prompts] if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)) else prompts


def _as_lists(value) -> list:
    """A tensor or array as nested lists; a list as it is."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _text(prompt: Prompt) -> str:
    """A cross-encoder's input: a text, or vLLM's TextPrompt dict around one."""
    text = unwrapped_prompt(prompt)[0] if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise ValueError("a cross-encoder scores pairs of texts: give data_1 and data_2 as strings (or "
                         "{\"prompt\": text})")
    return text


TOKENIZATION_KWARGS = ("truncation", "max_length", "add_special_tokens")


def _tokenizer_call(tokenizer, kwargs: dict | None) -> Callable[[str], list[int]] | None:
    """text -> token ids as vLLM's tokenization_kwargs ask; None for none."""
    if not kwargs:
        return None
    if unknown := set(kwargs) - set(TOKENIZATION_KWARGS):
        raise ValueError(f"tokenization_kwargs takes {', '.join(TOKENIZATION_KWARGS)}; not {', '.join(sorted(unknown))}")
    return lambda text: tokenizer(text, **kwargs)["input_ids"]


def _joined(request_id: str, parts: list[tuple[RequestOutput, int]]) -> RequestOutput:
    """One prompt's output from those of its calls (each with its first sample's index)."""
    if len(parts) == 1:
        return parts[0][0]
    first = parts[0][0]
    outputs = [dataclasses.replace(c, index=start + c.index) for out, start in parts for c in out.outputs]
    # The prompt's cached tokens are those of the call that found the least: the later calls
    # find what the first computed.
    return dataclasses.replace(first, request_id=request_id, outputs=outputs,
                               num_cached_tokens=min(out.num_cached_tokens for out, _ in parts))


class _Logprobs:
    """Logprobs as vLLM's `LLM` gives them: per token `{token id: Logprob}`, the token itself first,
    then the top ones ranked 1, 2, ...; each token's text decoded once (None with detokenize=False).
    The engine's own outputs keep plain floats (the server formats those)."""

    def __init__(self, tokenizer, detokenize: bool = True) -> None:
        self.tokenizer, self.detokenize = tokenizer, detokenize
        self.texts: dict[int, str | None] = {}

    def text(self, token_id: int) -> str | None:
        if token_id not in self.texts:
            tok = self.tokenizer
            self.texts[token_id] = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(token_id)]) \
                if self.detokenize else None
        return self.texts[token_id]

    def entry(self, token_id: int, logprob: float, rank: int | None, top) -> dict[int, Logprob]:
        """`top`: (token id, logprob) pairs, most likely first (a token among them takes its rank there)."""
        out = {token_id: Logprob(logprob, rank, self.text(token_id))}
        out.update((t, Logprob(lp, r, self.text(t))) for r, (t, lp) in enumerate(top, 1))
        return out

    def request_output(self, out: RequestOutput, params: SamplingParams) -> RequestOutput:
        """`out`'s logprobs and prompt logprobs (which start with None) as vLLM's."""
        outputs, prompt_logprobs = out.outputs, out.prompt_logprobs
        if params.logprobs is not None:  # an engine entry: the top ones in order, then the sampled token
            top = None if params.logprobs == -1 else params.logprobs  # -1: the whole vocabulary
            outputs = [dataclasses.replace(c, logprobs=[
                self.entry(t, e[t], rank, list(e.items())[:top])
                for t, e, rank in zip(c.token_ids, c.logprobs, c.ranks or itertools.repeat(None))]) for c in outputs]
        if prompt_logprobs is not None:
            prompt_logprobs = [None if p is None else self.entry(p.token_id, p.logprob, p.rank, p.top)
                               for p in prompt_logprobs]
        return dataclasses.replace(out, outputs=outputs, prompt_logprobs=prompt_logprobs, lora_request=params.lora_request)

    def beam(self, seq: BeamSearchSequence, num_prompt_tokens: int) -> BeamSearchSequence:
        """A beam's round logprobs (its token among the round's best, ranked where it stands)."""
        return dataclasses.replace(seq, logprobs=[
            self.entry(t, e[t], None, sorted(e.items(), key=lambda kv: kv[1], reverse=True))
            for t, e in zip(seq.tokens[num_prompt_tokens:], seq.logprobs)])


def _progress(total: int, use_tqdm: bool | Callable):
    """A progress bar over `total` prompts (`use_tqdm`: tqdm's class, or the one to use), or None."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):  # vLLM's keywords, for a class written for them
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
