"""The OpenAI endpoints' logic, free of HTTP and Ray: validate, tokenize, dispatch, shape replies.

    request model --sampling_params()--> SamplingParams          (400 naming the field)
    prompt / messages --chat template, tokenizer--> token ids    (tokenized here, at the ingress)
    token ids + limits from the engine --> 400 if too long       (before any engine slot is used)
    engine.generate(...) per prompt, merged --> one reply, or SSE events ending in [DONE]

The first engine output is awaited before a reply starts, so errors the engine finds (a request
that can never fit its KV cache, a full queue) still get their status code; errors after that
point in a stream are sent as one `data: {"error": ...}` event before `data: [DONE]`.

A stream sends a chunk for every engine output that made tokens, also when its text is empty
(the detokenizer holds back bytes that do not yet form a whole UTF-8 character), as vLLM does:
clients see progress, and the first chunk marks the first token.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from engine.block_manager import kv_tokens
from engine.chat_format import as_parts, developer_as_system, resolved
from engine.errors import InvalidRequestError
from engine.outputs import ChoiceDelta, StepOutput
from engine.sampling_params import SamplingParams, framing_tokens, priority_refusal, truncated
from engine.pooling import PoolerConfig
from engine.scoring import (cut_document, cut_pair, pair_length, pair_prompts, pair_scores, score_pairs,
                            templated_prompts)
from engine.structured.params import StructuredOutputsParams
from engine.beam_search import BeamSearch, BeamSearchAborted, Generate, beam_search
from router.background import BackgroundRuns, EventLog, check_id_free, run_in_background, stream_in_background
from router.chunk_streams import ChunkStreams
from router.embeddings import BinaryReply, classification_response, embedding_params, embedding_response
from router.scores import RerankRequest, ScoreRequest, rerank_response, score_response
from router.engine_streams import collect, events, logged_outputs, map_steps, merge_streams, renumbered, sample_calls
from router.errors import OpenAIError, bad_request, from_invalid_request, internal_error, unavailable
from router.formatting import (Accumulator, PromptEcho, chat_logprobs, chat_response, completion_response,
                               vllm_prompt_logprobs)
from router.lora_modules import LoRAModules
from router.off_loop import off_loop
from router.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest, DetokenizeRequest,
                             EmbeddingRequest, InputPoolingFields, PoolingFields, PoolingRequest, TokenizeRequest)
from router.reasoning import (END, count_reasoning_tokens, grammar_gate, opens_in_reasoning, reasoning_fields,
                              reply_start, split_reasoning)
from router.response_store import ResponseStore, StoredResponses
from router.response_reply import ResponseReply
from router.responses import ResponsesRequest, parse_items, responses_field
from router.settings import RouterSettings
from router.structured import check_all, checked, from_response_format, from_structured_outputs
from router.tools import ToolPlan, render, template_knows_tools

logger = logging.getLogger(__name__)

LIMITS_TTL_S = 10.0  # how long the ingress trusts the engine's limits (OpenAIServing.limits)
LIMITS_TIMEOUT_S = 30.0  # how long asking them may take: a seat on a busy replica, not forever
POOLING_ROUTE_TASKS = ("embed", "token_embed", "classify", "token_classify")  # /pooling's (score: /score)


async def beam_replies(search: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """A beam search's output, an engine that stopped one of its requests a 503 `unavailable`."""
    try:
        async for step in search:
            yield step
    except BeamSearchAborted as e:
        raise unavailable(f"{e}. Retry.") from None


class ReplicaClient(Protocol):
    """How the endpoints reach the engine replicas (router.ingress: through a Serve handle)."""

    async def info(self) -> dict: ...  # max_model_len, max_num_seqs, ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 admitted: bool = False) -> AsyncIterator[StepOutput]: ...
    # admitted: a later call of a request whose first call was let in, which a full queue makes
    # wait rather than refuse (router.ingress)


class OpenAIServing:
    def __init__(self, tokenizer, engine: ReplicaClient, settings: RouterSettings,
                 store: ResponseStore | None = None) -> None:
        """`store`: where responses are kept (one shared by several ingress replicas); default:
        one of its own, of settings.responses_store_max_bytes (0: none)."""
        self.tokenizer = tokenizer
        self.engine = engine
        self.settings = settings
        if store is None and settings.responses_store_max_bytes:
            store = ResponseStore(settings.responses_store_max_bytes)
        self.stored = StoredResponses(store)  # GET / DELETE /v1/responses/{id} and previous_response_id
        self.background = BackgroundRuns(self.stored)  # this replica's background responses
        self._info: dict | None = None
        self._info_at = 0.0  # time.monotonic() of the engine info in _info
        self._info_lock = asyncio.Lock()
        self._refresh: asyncio.Task | None = None  # asking the engine's limits again
        self._created = int(time.time())  # the model objects' `created`: when this server started serving it
        self.token_str = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)
        # --lora-modules (and those loaded at run time), by the name requests send
        self.adapters = LoRAModules(settings.lora_modules, (settings.served_model_name, *settings.served_model_aliases),
                                    settings.max_lora_rank, settings.lora_dims)
        self.chunks = ChunkStreams(self.reply_model, settings.response_role, self.token_bytes,
                                   settings.enable_force_include_usage)

    @functools.cached_property
    def _byte_tokenizer(self):
        """llguidance's view of the tokenizer, which knows each token's bytes (built on first use,
        ~0.4 s); None for a tokenizer it cannot read."""
        try:
            from llguidance.hf import from_tokenizer

            return from_tokenizer(self.tokenizer)
        except Exception:
            logger.warning("logprobs give each token's bytes as its decoded text's", exc_info=True)
            return None

    def _token_bytes(self, token_id: int) -> list[int]:
        if self._byte_tokenizer is None:
            return list(self.token_str(token_id).encode("utf-8"))
        return list(self._byte_tokenizer.decode_bytes([token_id]))

    @property
    def served_names(self) -> tuple[str, ...]:
        """The `model` names requests may send: the served model's, then its LoRA adapters'."""
        return (self.settings.served_model_name, *self.settings.served_model_aliases, *self.adapters)

    def reply_model(self, model: str | None) -> str:
        """The name a reply gives the model: the LoRA adapter's where the request named one (as
        vLLM's), else the served model's first name."""
        return model if model in self.adapters else self.settings.served_model_name

    async def limits(self) -> dict:
        """The engine's limits (its max_model_len is the resolved one). The first request waits
        for them (LIMITS_TIMEOUT_S at most, then a 503 `unavailable`); later ones use the last
        answer while it is asked again, in the background, once it is LIMITS_TTL_S old: a config
        change replaces the engine replicas after this ingress may have asked an old one, and the
        limits must follow them, but the asking waits for a seat on a replica, which a loaded
        server may not free for a while."""
        if self._info is None:
            async with self._info_lock:  # one asks; the others wait for its answer
                if self._info is None:
                    self._info = await self._ask_limits()
                    self._info_at = time.monotonic()
        elif time.monotonic() - self._info_at > LIMITS_TTL_S and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self._refresh_limits())
        return self._info

    async def _ask_limits(self) -> dict:
        try:
            return await asyncio.wait_for(self.engine.info(), LIMITS_TIMEOUT_S)
        except TimeoutError:
            raise unavailable(f"The engine did not say its limits within {LIMITS_TIMEOUT_S:g}s. Retry.") from None

    async def _refresh_limits(self) -> None:
        try:
            self._info = await self._ask_limits()
        except Exception as e:
            logger.warning("engine limits not refreshed (%r); keeping the last", e)
        self._info_at = time.monotonic()  # a failure waits a TTL too, rather than asking every request

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # -- endpoints -------------------------------------------------------------------------------
    async def models(self) -> dict:
        return {"object": "list", "data": [await self.model(name) for name in self.served_names]}

    async def model(self, name: str) -> dict:
        """OpenAI's model object (`client.models.retrieve`); 404 for a name not served here."""
        self.check_model(name)
        info = await self.limits()
        root, parent = self.settings.model_root or self.settings.served_model_name, None
        if (lora := self.adapters.get(name)) is not None:  # vLLM's: an adapter's directory, and its base model
            root, parent = lora.lora_path, lora.base_model_name or self.settings.served_model_name
        # vLLM's ModelCard: the model it serves (`root`), and OpenAI's old permission object
        return {"id": name, "object": "model", "created": self._created, "owned_by": "kvserve",
                "root": root, "parent": parent,
                "max_model_len": info["max_model_len"], "permission": [{
                    "id": f"modelperm-{name}", "object": "model_permission", "created": self._created,
                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False}]}

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if req.messages is not None:
            tools = tuple(req.tools or ())
            plan = ToolPlan("auto" if tools else "none", tools, parser=self.settings.tool_call_parser)
            ids = await off_loop(self._chat_ids, req, plan)
        else:
            ids = await off_loop(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens is not False)
        info = await self.limits()
        out = {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's init arguments (file paths left out), its
        class and the chat template requests are rendered with."""
        config = _jsonable(dict(getattr(self.tokenizer, "init_kwargs", None) or {}))
        for path in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
            config.pop(path, None)
        config["tokenizer_class"] = type(self.tokenizer).__name__
        if template := self.settings.chat_template or getattr(self.tokenizer, "chat_template", None):
            config["chat_template"] = template
        return config

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        if any(t >= len(self.tokenizer) for t in req.tokens):
            raise bad_request(f"tokens must be in [0, {len(self.tokenizer)})", param="tokens")
        return {"prompt": await off_loop(self.tokenizer.decode, req.tokens)}

    async def completions(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        self.check_model(req.model)
        await self._check_generates()
        req = await self._logprobs_within_cap(req, "logprobs")
        params = await self._constrained(self._params(req), *self._output_constraint(req))
        texts = req.prompts()
        self._check_sequences(len(texts), req.n)
        prompts = await off_loop(self._encoded, texts, req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:
            kept = [await self._truncated(p, req, req.max_tokens, "max_tokens") for p in prompts]
            texts = [t if len(k) == len(p) else k for t, p, k in zip(texts, prompts, kept)]  # echo: what was kept
            prompts = kept
        rid, engine_rid = _request_ids("cmpl", req.request_id)
        first, merged = await self._start(engine_rid, prompts, params, "prompt", "max_tokens", req.beam_search())
        if req.max_tokens == 0:
            first, merged = (first[0], _prompt_only(first[1])), map_steps(merged, _prompt_only)
        acc = Accumulator([len(p) for p in prompts], req.n)
        echo = None
        if req.echo or req.prompt_logprobs is not None:
            texts = [t if isinstance(t, str) else self.tokenizer.decode(t) for t in texts] if req.echo else None
            echo = PromptEcho(texts, prompts, req.prompt_logprobs, self.token_str)
        if req.stream:
            return self.chunks.completion(rid, req, acc, first, merged, echo, prompts, self._token_str(req))
        await collect(acc, first, merged)
        response = completion_response(rid, int(time.time()), self.reply_model(req.model), acc, req.logprobs,
                                       self._token_str(req), echo)
        if req.return_token_ids:
            for i, choice in enumerate(response["choices"]):
                choice.update(prompt_token_ids=prompts[i // req.n], token_ids=acc.choices[i].token_ids)
        return response

    async def embeddings(self, req: EmbeddingRequest) -> dict | BinaryReply:
        """Each input's embedding, from a pooling engine (engine.pooling; a 400 from one that generates)."""
        return await self._embeddings(req, "Embeddings", "embd", "embedding")

    async def pooling(self, req: PoolingRequest) -> dict | BinaryReply:
        """vLLM's /pooling: each input's vector in its reply's shape: an embedding model's
        embedding (task "embed") or a vector for each token ("token_embed"), a classifier's
        probabilities ("classify"), a token classifier's probabilities for each token
        ("token_classify"); by default the model's first task."""
        pooler = await self._pooler()
        task = req.task or (pooler.tasks[0] if pooler is not None else "embed")
        if task not in POOLING_ROUTE_TASKS:
            raise bad_request(f"Task {task} is not supported by /pooling: it pools for "
                              f"{', '.join(POOLING_ROUTE_TASKS)} (/score scores pairs)", param="task")
        params = await self._pooling_params(req, "Pooling", req.dimensions, task, "task")
        rid, prompts, vectors = await self._pooled_inputs(req, params, "pool")
        return embedding_response(rid, self.reply_model(req.model), vectors, sum(map(len, prompts)),
                                  req, "pooling")

    async def classify(self, req: ClassificationRequest) -> dict:
        """vLLM's /classify: each input's class probabilities and likeliest label, from a
        sequence classifier (engine.classifier)."""
        params = await self._pooling_params(req, "Classification", task="classify")
        rid, prompts, probs = await self._pooled_inputs(req, params, "classify")
        return classification_response(rid, self.reply_model(req.model), probs, (await self._pooler()).classifier,
                                       sum(map(len, prompts)))

    async def _embeddings(self, req: EmbeddingRequest, api: str, prefix: str, kind: str) -> dict | BinaryReply:
        params = await self._pooling_params(req, api, req.dimensions)
        rid, prompts, vectors = await self._pooled_inputs(req, params, prefix)
        return embedding_response(rid, self.reply_model(req.model), vectors, sum(map(len, prompts)),
                                  req, kind)

    async def _pooled_inputs(self, req: InputPoolingFields, params: SamplingParams,
                             prefix: str) -> tuple[str, list[list[int]], list[list[float]]]:
        """-> (the reply's id, the prompts run, their vectors): each of the body's inputs (or its
        conversation) pooled with `params`."""
        inputs = req.prompts() if req.messages is None else []
        self._check_inputs(len(inputs), "input")
        if req.messages is not None:
            prompts = [await off_loop(self._chat_ids, req, ToolPlan("none", ()))]
        else:
            prompts = await off_loop(self._encoded, inputs, req.add_special_tokens is not False)
        prompts = await self._fitted(prompts, params, req, "input")
        rid, engine_rid = _request_ids(prefix, req.request_id)
        return rid, prompts, await self._vectors(engine_rid, prompts, params)

    async def score(self, req: ScoreRequest) -> dict:
        """vLLM's /score: each pair's score (router.scores)."""
        rid, scores, num_tokens = await self._scored(req, "Score", "score", (req.firsts(), req.seconds()),
                                                     req.names())
        return score_response(rid, self.reply_model(req.model), scores, num_tokens)

    async def rerank(self, req: RerankRequest) -> dict:
        """vLLM's /rerank (Jina's, Cohere's): the documents by their score against the query."""
        rid, scores, num_tokens = await self._scored(req, "Rerank", "rerank", ([req.query], req.texts()),
                                                     ("query", "documents"))
        return rerank_response(rid, self.reply_model(req.model), req, scores, num_tokens)

    async def _scored(self, req: ScoreRequest | RerankRequest, api: str, prefix: str,
                      sides: tuple[list[str], list[str]], names: tuple[str, str]) -> tuple[str, list[float], int]:
        """-> (the reply's id, each pair's score, the tokens run): an embedding model's cosine of
        the two texts' vectors, every text of the two `sides` (their fields: `names`) embedded
        once; a cross-encoder's score of each pair read as one prompt (`_cross_encoded`). Each
        side's texts keep their first max_tokens_per_query / max_tokens_per_doc tokens where the
        request gives them (vLLM's; Cohere's max_tokens_per_doc)."""
        for texts, name in zip(sides, names):
            self._check_inputs(len(texts), name)
        pooler = await self._pooler()
        if req.template_variables():
            given = "instruction" if req.instruction is not None else "chat_template_kwargs"
            if pooler is None or pooler.classifier is None:
                raise bad_request(f"{given} is for a cross-encoder's score template: this model embeds each text on "
                                  "its own and scores the pair by their cosine", param=given)
            if self.settings.chat_template is None:
                raise bad_request(f"{given} is for a cross-encoder's score template: start the server with "
                                  "--chat-template (a template reading the query and document messages)", param=given)
        if pooler is not None and pooler.classifier is not None:
            return await self._cross_encoded(req, api, prefix, sides, names, pooler.classifier.use_pad_token)
        params = await self._pooling_params(req, api)
        firsts, seconds = [await off_loop(self._encoded, texts, True) for texts in sides]
        ends = framing_tokens(self.tokenizer, pooler)  # an encoder's text keeps its [CLS] and [SEP] around them
        firsts, seconds = [ids if n is None else [cut_document(p, n, ends) for p in ids]
                           for ids, n in zip((firsts, seconds), req.side_limits())]
        firsts, seconds = [await self._fitted(p, params, req, name) for p, name in zip((firsts, seconds), names)]
        rid, engine_rid = _request_ids(prefix, req.request_id)
        vectors = await self._vectors(engine_rid, firsts + seconds, params)
        scores = await off_loop(pair_scores, vectors[:len(firsts)], vectors[len(firsts):])
        return rid, scores, sum(map(len, firsts + seconds))

    async def _cross_encoded(self, req: ScoreRequest | RerankRequest, api: str, prefix: str,
                             sides: tuple[list[str], list[str]], names: tuple[str, str],
                             use_pad_token: bool) -> tuple[str, list[float], int]:
        """_scored's on a cross-encoder: each pair one prompt (engine.scoring.pair_prompts; rendered
        by the server's --chat-template where it has one, a score template: templated_prompts),
        its score the head's; a text cut to max_tokens_per_query / max_tokens_per_doc keeps the text
        of its first tokens, as vLLM cuts it before composing the pair."""
        params = await self._pooling_params(req, api, task="score")
        firsts, seconds = [texts if n is None else await off_loop(self._cut_texts, texts, n)
                           for texts, n in zip(sides, req.side_limits())]
        pairs = [(firsts[i], seconds[j]) for i, j in score_pairs(len(firsts), len(seconds))]
        if self.settings.chat_template is not None:
            return await self._template_scored(req, params, prefix, pairs, names)
        max_model_len = (await self.limits())["max_model_len"]
        try:
            keep = pair_length(req.truncate_prompt_tokens, max_model_len)
            if req.truncation_side is None:  # the tokenizer cuts the pair, the longer text first
                prompts, starts = await off_loop(pair_prompts, self.tokenizer, pairs, use_pad_token, keep)
            else:  # vLLM's: the pair whole, then its tokens cut on that side (an encoder's framing kept)
                prompts, starts = await off_loop(pair_prompts, self.tokenizer, pairs, use_pad_token)
                if keep is not None:
                    ends = framing_tokens(self.tokenizer, await self._pooler())
                    prompts, starts = map(list, zip(*(cut_pair(p, s, keep, max_model_len, req.truncation_side, ends)
                                                      for p, s in zip(prompts, starts))))
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
        blamed = names[1]
        if keep is None and any(len(p) > max_model_len for p in prompts):  # the query's, where it alone is too long
            blamed = await off_loop(self._too_long_side, pairs, prompts, max_model_len, use_pad_token, names)
        await self._check_prompts(prompts, params, blamed, blamed)
        rid, engine_rid = _request_ids(prefix, req.request_id)
        vectors = await self._vectors(engine_rid, prompts, [dataclasses.replace(params, pooling=dataclasses.replace(
            params.pooling, token_type_start=s)) for s in starts])
        return rid, [v[0] for v in vectors], sum(map(len, prompts))

    def _too_long_side(self, pairs: list[tuple[str, str]], prompts: list[list[int]], max_model_len: int,
                       use_pad_token: bool, names: tuple[str, str]) -> str:
        """The field to name for a pair too long for the model: the first text's (the query's)
        where it leaves no room for one token of the second with the pair's special tokens, else
        the second's."""
        specials = self.tokenizer.num_special_tokens_to_add(pair=True) if use_pad_token else 0
        for (first, _), ids in zip(pairs, prompts):
            if len(ids) > max_model_len and len(self.tokenizer.encode(first, add_special_tokens=False)) + specials + 1 \
                    > max_model_len:
                return names[0]
        return names[1]

    async def _template_scored(self, req: ScoreRequest | RerankRequest, params: SamplingParams, prefix: str,
                               pairs: list[tuple[str, str]], names: tuple[str, str]) -> tuple[str, list[float], int]:
        """_cross_encoded's under a score template: each pair rendered (engine.scoring.templated_prompts)
        with the request's variables over the server's, then cut and checked as any prompt is."""
        variables = {**(self.settings.default_chat_template_kwargs or {}), **req.template_variables()}
        try:
            prompts = await off_loop(templated_prompts, self.tokenizer, pairs, self.settings.chat_template, variables)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
        blamed, limit = names[1], (await self.limits())["max_model_len"]
        if req.truncate_prompt_tokens is None and any(len(p) > limit for p in prompts):
            blamed = await off_loop(self._too_long_in_template, pairs, prompts, limit, variables, req, names)
        prompts = await self._fitted(prompts, params, req, blamed)
        rid, engine_rid = _request_ids(prefix, req.request_id)
        return rid, [v[0] for v in await self._vectors(engine_rid, prompts, params)], sum(map(len, prompts))

    def _too_long_in_template(self, pairs: list[tuple[str, str]], prompts: list[list[int]], limit: int,
                              variables: dict, req: ScoreRequest | RerankRequest, names: tuple[str, str]) -> str:
        """The field to name for a templated pair too long for the model: the template's variables
        (the instruction) where the template around an empty pair is too long already; the
        query's where it is with the query alone; else the document side's."""
        def too_long(first: str) -> bool:
            return len(templated_prompts(self.tokenizer, [(first, "")], self.settings.chat_template, variables)[0]) \
                > limit

        for (first, _), ids in zip(pairs, prompts):
            if len(ids) > limit and req.template_variables() and too_long(""):
                return "instruction" if req.instruction is not None else "chat_template_kwargs"
            if len(ids) > limit and too_long(first):
                return names[0]
        return names[1]

    def _cut_texts(self, texts: list[str], max_tokens: int) -> list[str]:
        cut = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return [t if len(ids) <= max_tokens else self.tokenizer.decode(ids[:max_tokens]) for t, ids in zip(texts, cut)]

    async def _pooler(self) -> PoolerConfig | None:
        """How the engine pools (engine.pooling), None where it generates."""
        fields = (await self.limits()).get("pooler")
        return None if fields is None else PoolerConfig.from_fields(fields)

    async def _pooling_params(self, req: PoolingFields, api: str, dimensions: int | None = None,
                              task: str = "embed", task_param: str = "model") -> SamplingParams:
        self.check_model(req.model)
        params = embedding_params(req, await self._pooler(), api, dimensions, task, task_param)
        lora = self.adapters.get(req.model)
        return params if lora is None else dataclasses.replace(params, lora_request=lora)

    def _check_inputs(self, num_inputs: int, param: str) -> None:
        """--max-sequences-per-request bounds an embedding request's inputs (checked before any is tokenized)."""
        limit = self.settings.sequence_limit(pooling=True)
        if num_inputs > limit:
            raise bad_request(f"this request has {num_inputs} inputs; this server takes at most {limit} per request "
                              "(--max-sequences-per-request)", param=param)

    async def _fitted(self, prompts: list[list[int]], params: SamplingParams,
                      req: PoolingFields, param: str) -> list[list[int]]:
        """The prompts an embedding request's `param` runs: each truncated as the request asks,
        then checked (a 400 naming `param` for one the engine would refuse)."""
        if req.truncate_prompt_tokens is not None:
            ends = framing_tokens(self.tokenizer, await self._pooler())
            prompts = [await self._truncated(p, req, 0, param, ends=ends, side="right") for p in prompts]
        await self._check_prompts(prompts, params, param, param)
        return prompts

    async def _vectors(self, rid: str, prompts: list[list[int]],
                       params: SamplingParams | list[SamplingParams]) -> list[list[float]]:
        """The prompts' vectors, in order, from a pooling engine (`params`: the same for every
        prompt, or each one's)."""
        first, merged = await self._send(rid, prompts, params)
        vectors: list[list[float] | None] = [None] * len(prompts)
        vectors[first[0]] = first[1].pooled
        async with contextlib.aclosing(merged):
            async for i, step in merged:
                if step.pooled is not None:
                    vectors[i] = step.pooled
        if any(v is None for v in vectors):  # ended without its vector: aborted under it
            raise internal_error()
        return vectors

    async def chat(self, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        self.check_model(req.model)
        await self._check_generates()
        self._check_sequences(1, req.n)
        req = await self._logprobs_within_cap(req, "top_logprobs")
        plan, params, ids, thinking = await self._chat_prompt(req)
        max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if req.truncate_prompt_tokens is not None:
            ids = await self._truncated(ids, req, req.max_completion_tokens or req.max_tokens, max_param)
        rid, engine_rid = _request_ids("chatcmpl", req.request_id)
        first, merged = await self._start(engine_rid, [ids], params, "messages", max_param, req.beam_search())
        acc = Accumulator([len(ids)], req.n)
        if req.stream:
            return self.chunks.chat(rid, req, acc, first, merged, plan, ids, thinking, self._token_str(req))
        await collect(acc, first, merged)
        k = (req.top_logprobs or 0) if req.logprobs else None
        token_str = self._token_str(req)
        response = chat_response(rid, int(time.time()), self.reply_model(req.model), acc, k, token_str,
                                 self.token_bytes, req.reply_role(self.settings.response_role))
        for choice in response["choices"]:
            if self.settings.reasoning_parser is not None:  # the answer, not the reasoning, may hold tool calls
                message, reasoning = choice["message"], None
                if thinking is not None:
                    reasoning, message["content"] = split_reasoning(message["content"], thinking)
                message.update(reasoning_fields(reasoning if req.include_reasoning else None))
            if plan.calls_tools:
                plan.apply(choice)
            if echoed := req.echoed_text(self.settings.response_role):  # vLLM's order: after the tool calls
                choice["message"]["content"] = echoed + (choice["message"]["content"] or "")
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = vllm_prompt_logprobs(acc.prompt_logprobs[0], req.prompt_logprobs,
                                                               self.token_str)  # text, as vLLM's
        if req.return_token_ids:
            response["prompt_token_ids"] = ids
            for choice, state in zip(response["choices"], acc.choices):
                choice["token_ids"] = state.token_ids
        return response

    async def responses(self, req: ResponsesRequest) -> dict | AsyncIterator[str]:
        """OpenAI's Responses API, run as the chat request it amounts to (router.responses)."""
        self.check_model(req.model)
        await self._check_generates()
        history = await self.stored.conversation(req.previous_response_id)
        chat = await self._logprobs_within_cap(req.chat_request(parse_items(history)), "top_logprobs")
        plan, params, ids, thinking = await self._chat_prompt(chat, field=responses_field)
        if chat.truncate_prompt_tokens is not None:  # truncation auto
            ids = await self._truncated(ids, chat, chat.max_completion_tokens, "max_output_tokens",
                                        'truncation "auto"')
        counter = None if thinking is None else functools.partial(count_reasoning_tokens, decode=self.tokenizer.decode,
                                                                  in_reasoning=thinking)
        scored = None if params.logprobs is None else (  # include message.output_text.logprobs
            lambda ids, entries: chat_logprobs(ids, entries, params.logprobs, self.token_str,
                                               self.token_bytes)["content"])
        run = uuid.uuid4().hex if req.background else None  # the run's token (router.background)
        reply = ResponseReply(req, self.reply_model(req.model), int(time.time()), plan,
                              self.stored.keeper(req, history, run), thinking, counter, scored)
        engine_rid = reply.id if req.request_id is None else f"{reply.id}-{uuid.uuid4().hex[:16]}"  # unique
        if req.request_id is not None and req.store and self.stored.store is not None:
            check_id_free(self.background, await self.stored.store.get(reply.id), reply.id)
        if req.background:
            return await self._in_background(reply, run, engine_rid, ids, params)
        first, merged = await self._start(engine_rid, [ids], params, "input", "max_output_tokens")
        acc = Accumulator([len(ids)], 1)
        if req.stream:
            return _response_events(reply, acc, first, merged)
        await collect(acc, first, merged)
        return await reply.whole(acc)

    async def _in_background(self, reply: ResponseReply, run: str, rid: str, ids: list[int],
                             params: SamplingParams) -> dict | AsyncIterator[str]:
        """A background response (router.background): checked now, answered queued (a stream: its
        events, from response.created with the response queued), run later."""
        if self.stored.store is None:
            raise bad_request("background needs the response store, which is off on this server "
                              "(--responses-store-max-bytes 0)", "background")
        with self.background.reserved(self.settings.max_background_responses, self.settings.overload_status,
                                      self.settings.retry_after_s):
            params = await self._checked([ids], params, "input", "max_output_tokens")  # a 400 now, not a failed run
            queued = await reply.queued()  # taking its id: refused where a run holds it
            if not queued["store"]:
                check_id_free(self.background, await self.stored.store.get(reply.id), reply.id)
                raise bad_request("this request is larger than the response store holds "
                                  "(--responses-store-max-bytes), so its background run could not be followed", "input")
            # accepted: the run waits for room in a full engine queue, where a new request is refused
            start = functools.partial(self._send, rid, [ids], params, admitted=True)
            acc = Accumulator([len(ids)], 1)
            if not reply.req.stream:
                self.background.start(reply.id, run, run_in_background(reply, start, acc))
                return queued
            log = EventLog()
            for kind in ("response.created", "response.queued"):  # OpenAI's two, then in_progress when it starts
                await log.add(reply.event(kind, response=queued))
            self.background.start(reply.id, run, stream_in_background(reply, start, acc, log), log)
            return log.follow()

    # -- shared steps ----------------------------------------------------------------------------
    async def _check_generates(self) -> None:
        """A 400 before anything starts (a background response too) where the engine pools."""
        pooler = await self._pooler()
        if pooler is not None and pooler.classifier is not None:
            routes = {"score": "/classify, /score or /rerank", "token_classify": "/pooling"}
            route = next((r for task, r in routes.items() if task in pooler.tasks), "/classify")
            raise bad_request(f"The model is served for classification (--runner pooling; {pooler.classifier.kind}): "
                              f"it does not generate; use {route}", param="model")
        if pooler is not None:
            raise bad_request("The model is served for embeddings (--runner pooling): it does not generate; "
                              "use /v1/embeddings, /score or /rerank", param="model")

    def _check_sequences(self, num_prompts: int, n: int) -> None:
        """--max-sequences-per-request bounds a request's prompts x n (n alone goes up to vLLM's 16,384)."""
        limit = self.settings.sequence_limit()
        if num_prompts * n > limit:
            raise bad_request(f"this request asks for {num_prompts} prompts x n={n} = {num_prompts * n} sequences; "
                              f"this server allows at most {limit} per request (--max-sequences-per-request)",
                              param="n" if num_prompts == 1 else "prompt")

    def _params(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """The request's sampling params, with the LoRA adapter its `model` names."""
        try:
            params = req.sampling_params(self.settings.sampling_defaults)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
        self.check_model(req.model)  # again, with no await before the lookup: an unloaded module is a 404
        lora = self.adapters.get(req.model)
        return params if lora is None else dataclasses.replace(params, lora_request=lora)

    def _token_str(self, req: CompletionRequest | ChatCompletionRequest) -> Callable[[int], str]:
        """How logprobs name a token: its text, or vLLM's "token_id:{id}" (return_tokens_as_token_ids)."""
        as_ids = req.return_tokens_as_token_ids
        return _as_token_id if (self.settings.return_tokens_as_token_ids if as_ids is None else as_ids) \
            else self.token_str

    @staticmethod
    def _output_constraint(req: CompletionRequest | ChatCompletionRequest,
                           ) -> tuple[StructuredOutputsParams | None, str]:
        """The request's constraint on its output, and the field that set it (validation allows one)."""
        spec = from_response_format(req.response_format)
        if spec is not None:
            return spec, "response_format"
        return from_structured_outputs(req.structured_outputs), req.structured_param

    @staticmethod
    async def _constrained(params: SamplingParams, spec, param: str) -> SamplingParams:
        """`params` constrained to `spec` (engine.structured) once it is known to compile; 400 else."""
        if spec is None:
            return params
        return dataclasses.replace(params, structured_outputs=await checked(spec, param))

    async def _truncated(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest,
                         max_tokens: int | None, max_param: str, asked: str = "truncate_prompt_tokens -1",
                         ends: tuple[int, int] | None = None, side: str | None = None) -> list[int]:
        """The prompt the request's truncate_prompt_tokens keeps (-1: what leaves room for max_tokens,
        the request's `max_param`; `asked`: how the request said -1, for the errors; `ends`: an
        encoder's framing tokens, kept; `side`: the side cut where the request names none)."""
        try:
            return truncated(ids, req.truncate_prompt_tokens, (await self.limits())["max_model_len"], max_tokens,
                             req.truncation_side or side, max_param, asked, ends)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None

    async def _chat_prompt(self, req: ChatCompletionRequest, field: Callable[[str], str] = str,
                           ) -> tuple[ToolPlan, SamplingParams, list[int], bool | None]:
        """What the chat path runs for `req`: its tool plan, its sampling params with every
        constraint on the output, its rendered prompt, and whether the reply opens inside its
        reasoning (None: the reply is not split; router.reasoning). `field` names a chat field
        in the errors as the caller's request names it."""
        plan = ToolPlan.of(req, self.settings.tool_call_parser, self.settings.exclude_tools_when_tool_choice_none)
        params = self._params(req)
        if plan.calls_tools and plan.format.special_tokens:  # the calls' tag shows (vLLM's adjust_request)
            params = dataclasses.replace(params, skip_special_tokens=False)
        await check_all([(spec, field(param)) for spec, param in plan.tool_specs()])
        for spec, param in (self._output_constraint(req), (plan.spec(), "tools")):
            params = await self._constrained(params, spec, field(param))
        ids = await off_loop(self._chat_ids, req, plan, field)
        parser = self.settings.reasoning_parser
        if parser is None:
            return plan, params, ids, None
        start = reply_start(self.tokenizer.decode(ids[-REASONING_TAIL:]), req.messages[-1].text(),
                            req.continue_final_message)
        spec = params.structured_outputs
        if spec is None:
            return plan, params, ids, opens_in_reasoning(parser, start)
        if not self._end_tag_is_a_token or self.settings.structured_outputs_in_reasoning:
            return plan, params, ids, None  # the grammar governs the whole reply
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, **grammar_gate(parser, start)))
        return plan, params, ids, opens_in_reasoning(parser, start)

    @functools.cached_property
    def _end_tag_is_a_token(self) -> bool:
        """Whether `</think>` is one token here, as the engine's grammar gate needs (engine.structured.gate)."""
        return len(self.tokenizer.encode(END, add_special_tokens=False)) == 1

    def _encoded(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        return [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
                for p in prompts]

    def _chat_ids(self, req: ChatCompletionRequest | TokenizeRequest, plan: ToolPlan,
                  field: Callable[[str], str] = str) -> list[int]:
        """`field` names a chat field as the caller's request names it."""
        param = field("messages")
        template = self.settings.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise bad_request("this model has no chat template: give the text itself (`prompt`, or `input` on the "
                              "pooling routes), or start the server with --chat-template", param=param)
        # the server's defaults, under the request's reasoning_effort, under its chat_template_kwargs
        variables = dict(self.settings.default_chat_template_kwargs or {})
        if effort := getattr(req, "reasoning_effort", None):  # vLLM passes it to the template, which may not read it
            variables["reasoning_effort"] = effort
        variables.update(req.chat_template_kwargs or {})
        msgs, tools = render(req.messages, plan, template_knows_tools(template))
        msgs = developer_as_system(msgs, template)
        if resolved(self.settings.chat_template_content_format, template) == "openai":
            msgs = [as_parts(m) for m in msgs]
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, tools=tools, chat_template=self.settings.chat_template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                documents=getattr(req, "documents", None), **variables)
        except Exception as e:  # jinja raises on conversations its template rejects
            raise bad_request(f"the chat template rejected these messages: {e}", param=param) from None
        return self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))

    async def _logprobs_within_cap(self, req, sample_field: str):
        """The request with vLLM's -1 (the whole vocabulary) resolved in its logprob counts
        (`sample_field`, prompt_logprobs); a 400 naming the field for more than the engine's
        max_logprobs, and for a beam search whose rounds would ask more (2 per beam)."""
        fields = [f for f in (sample_field, "prompt_logprobs") if getattr(req, f) is not None]
        if not fields and not req.use_beam_search:
            return req
        info = await self.limits()
        cap = info.get("max_logprobs")
        if cap is not None and cap != -1 and req.use_beam_search and 2 * req.n > cap:
            raise bad_request(f"use_beam_search with n={req.n} asks {2 * req.n} logprobs per beam round, more "
                              f"than this server's --max-logprobs ({cap})", param="n")
        asked = SamplingParams(logprobs=getattr(req, sample_field), prompt_logprobs=req.prompt_logprobs)
        try:
            asked = asked.within_logprobs_cap(-1 if cap is None else cap, info.get("vocab_size") or len(self.tokenizer),
                                              {"logprobs": sample_field})
        except InvalidRequestError as e:
            raise bad_request(e.message, param=e.param, code="invalid_value") from None
        return req.model_copy(update={sample_field: asked.logprobs, "prompt_logprobs": asked.prompt_logprobs})

    async def _check_prompts(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                             max_param: str) -> None:
        info = await self.limits()
        limit = info["max_model_len"]
        if params.priority != 0 and info.get("scheduling_policy", "fcfs") != "priority":
            raise bad_request(priority_refusal(params.priority), param="priority")
        if info.get("vocab_size") is not None:
            _check_token_ids(prompts, params, info["vocab_size"], prompt_param)
        for i, ids in enumerate(prompts):
            if not ids:  # which one, where the request has many
                raise bad_request("the prompt is empty" + (f" (input {i})" if len(prompts) > 1 else ""),
                                  param=prompt_param)
            if params.pooling is not None and len(ids) > limit:  # an embedding: nothing is generated after it
                raise bad_request(f"This model's maximum context length is {limit} tokens, but the input has "
                                  f"{len(ids)} tokens.", param=prompt_param, code="context_length_exceeded")
            if params.pooling is None and len(ids) >= limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt has "
                                  f"{len(ids)} tokens (it must leave room for at least one generated token).",
                                  param=prompt_param, code="context_length_exceeded")
            if params.pooling is not None:  # its prompt's KV alone (the engine checks the same)
                _check_prompt_fits_kv_cache(len(ids), info, prompt_param, "input")
                continue
            if params.max_tokens is not None and params.max_tokens > limit:  # past the prompt's room: cut (_fit)
                raise bad_request(f"This model's maximum context length is {limit} tokens, but {params.max_tokens} "
                                  f"{max_param} were requested. Lower {max_param}.", param=max_param,
                                  code="context_length_exceeded")
            _check_fits_kv_cache(len(ids), _fit(params, len(ids), limit).max_tokens, info, max_param, prompt_param)

    async def _start(self, rid: str, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                     max_param: str, beam: BeamSearch | None = None) -> tuple[tuple[int, StepOutput], AsyncIterator]:
        """Check the prompts and params (_checked), then send them (_send)."""
        return await self._send(rid, prompts, await self._checked(prompts, params, prompt_param, max_param), beam)

    async def _send(self, rid: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    beam: BeamSearch | None = None,
                    admitted: bool = False) -> tuple[tuple[int, StepOutput], AsyncIterator]:
        """Send every prompt (its params as _checked made them, or a list of each one's: a pooling
        request's) to the engine, or to a beam search over it; returns its first output and the
        rest of the merged stream. `admitted`: accepted already (a background run), its first
        call waits for room in a full queue as the later ones do."""
        if self.settings.enable_log_requests:
            n = self.settings.max_log_len
            logger.info("%s: prompt token ids %s, %s", rid, prompts if n is None else [p[:n] for p in prompts], params)
        # The first engine call lets the request in or refuses it (a full queue); the rest, more
        # prompts or beam rounds, are part of a request already running.
        sent = itertools.count()

        def generate(request_id: str, ids: list[int], p: SamplingParams) -> AsyncIterator[StepOutput]:
            return self.engine.generate(request_id, ids, p, admitted=next(sent) > 0 or admitted)

        info = await self.limits()
        if isinstance(params, list):  # one engine call each (pooling: n is 1)
            merged = merge_streams([generate(f"{rid}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))])
        elif beam is None:
            calls = sample_calls(len(prompts), params, info["max_num_seqs"])
            streams = []
            for i, first, p in calls:
                p = _fit(p, len(prompts[i]), info["max_model_len"])
                stream = generate(f"{rid}-{i}" + (f"-{first}" if first else ""), prompts[i], p)
                streams.append(renumbered(stream, first) if first else stream)
            merged = merge_streams(streams, owners=[i for i, _, _ in calls])
        else:
            limit = info["max_model_len"]
            merged = merge_streams([await self._beam_search(generate, f"{rid}-{i}", ids, _fit(params, len(ids), limit),
                                                            beam) for i, ids in enumerate(prompts)])
        if self.settings.enable_log_outputs:
            merged = logged_outputs(rid, merged, self.settings.max_log_len)
        try:
            first = await anext(merged)
        except StopAsyncIteration:
            raise internal_error() from None
        except InvalidRequestError as e:  # the engine's own validation, for whatever the checks above missed
            await merged.aclose()
            raise from_invalid_request(e) from None
        except BaseException:
            await merged.aclose()
            raise
        return first, merged

    async def _checked(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                       max_param: str) -> SamplingParams:
        """The params the prompts run with (max_tokens None: vLLM's default); a 400 for what the
        engine would refuse."""
        default = self.settings.sampling_defaults.get("max_tokens")
        if params.max_tokens is None and default is not None:  # vLLM's: the room left, at most the default
            room = (await self.limits())["max_model_len"] - max(map(len, prompts))
            params = dataclasses.replace(params, max_tokens=max(1, min(default, room)))
        await self._check_prompts(prompts, params, prompt_param, max_param)
        return params

    async def _beam_search(self, generate: Generate, rid: str, ids: list[int], params: SamplingParams,
                           beam: BeamSearch) -> AsyncIterator[StepOutput]:
        info = await self.limits()
        if params.max_tokens is None:  # as the engine would: up to max_model_len
            params = dataclasses.replace(params, max_tokens=info["max_model_len"] - len(ids))
        eos = info.get("eos_token_ids")
        eos = set(eos) if eos is not None else {self.tokenizer.eos_token_id} - {None}
        return beam_replies(beam_search(generate, rid, ids, params, beam, eos,
                                        lambda tokens, skip: self.tokenizer.decode(tokens, skip_special_tokens=skip)))


def _jsonable(value):
    """value with what JSON cannot hold as text (a special token's AddedToken: its content)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "content", None) or str(value)


async def _response_events(reply: ResponseReply, acc: Accumulator, first, merged: AsyncIterator) -> AsyncIterator[str]:
    async with contextlib.aclosing(merged):  # however the stream ends, the engine request ends
        async for event in reply.events(events(first, merged, acc, reply.error_event), acc):
            yield event


REASONING_TAIL = 256  # prompt tokens a reply's start in or out of reasoning is read from


def _request_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """-> (the reply's id, the engine's base request id). A client's id names the reply, as in
    vLLM (`chatcmpl-{id}`); the engine's id stays unique whatever ids clients send."""
    own = uuid.uuid4().hex
    if client_id is None:
        return f"{prefix}-{own}", f"{prefix}-{own}"
    return f"{prefix}-{client_id}", f"{prefix}-{client_id}-{own[:16]}"


def _as_token_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _prompt_only(step: StepOutput) -> StepOutput:
    """max_tokens 0: the reply is the prompt. The one token the engine drew is left out (and out
    of the usage), and the choice ends for its length, 0."""
    choices = [ChoiceDelta(c.index, "", [], None, c.finish_reason and "length") for c in step.choices]
    return dataclasses.replace(step, choices=choices)


def _fit(params: SamplingParams, prompt_len: int, limit: int) -> SamplingParams:
    """vLLM's reading of a max_tokens that runs past max_model_len after this prompt: cut to the room
    the prompt leaves (min_tokens with it), so that the reply ends there with finish_reason length.
    A pooling request's (its one draw; its input may fill max_model_len) is as it is."""
    room = limit - prompt_len
    if params.pooling is not None or params.max_tokens is None or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


def _check_fits_kv_cache(prompt_len: int, max_tokens: int | None, info: dict, max_param: str,
                         prompt_param: str) -> None:
    """A sequence needing more KV blocks than the whole cache holds could never be scheduled: a 400
    here rather than from an engine replica (whose refusal Serve logs as a failed request), naming
    the prompt where it alone is too long. The engine checks the same; max_tokens None runs to
    max_model_len there."""
    blocks, size = info.get("num_total_blocks"), info.get("block_size")
    if not blocks or not size:
        return
    _check_prompt_fits_kv_cache(prompt_len, info, prompt_param)
    total = prompt_len + (max_tokens if max_tokens is not None else info["max_model_len"] - prompt_len)
    if -(-kv_tokens(prompt_len, total - prompt_len) // size) > blocks:
        asked = (f"{total - prompt_len} {max_param}" if max_tokens is not None else
                 f"{total - prompt_len} tokens to max_model_len (no {max_param} given)")
        raise bad_request(f"The KV cache holds {blocks * size} tokens, but {prompt_len} prompt tokens + {asked} "
                          f"need {total - 1} (all but the last): this request could never be scheduled. "
                          f"{'Lower' if max_tokens is not None else 'Set'} {max_param}.", param=max_param)


def _check_prompt_fits_kv_cache(prompt_len: int, info: dict, prompt_param: str, noun: str = "prompt") -> None:
    """A prompt whose KV alone is more than the whole cache holds: a 400 naming it (a shorter one
    is the only remedy)."""
    blocks, size = info.get("num_total_blocks"), info.get("block_size")
    if blocks and size and -(-prompt_len // size) > blocks:
        raise bad_request(f"The KV cache holds {blocks * size} tokens, but the {noun} has {prompt_len}: this request "
                          f"could never be scheduled. Shorten the {noun}.", param=prompt_param)


def _check_token_ids(prompts: list[list[int]], params: SamplingParams, vocab: int, prompt_param: str) -> None:
    """Token ids the model does not have: a 400 here, without a trip to an engine replica (whose
    refusal Serve logs as a failed request, with its traceback). The engine checks the same."""
    if any(p and not (0 <= min(p) and max(p) < vocab) for p in prompts):
        raise bad_request(f"{prompt_param} token ids must be in [0, {vocab})", param=prompt_param)
    try:
        params.check_token_ids(vocab)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None
