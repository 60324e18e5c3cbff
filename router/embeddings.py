"""POST /v1/embeddings: the params an embedding request runs with on a pooling engine
(engine.pooling), and OpenAI's reply. The vectors come from the engine as any request's outputs
do; only this hop turns them into JSON floats or OpenAI's base64 (little-endian float32 bytes,
what the openai client asks for by default and decodes; vLLM's `embed_dtype` and `endianness`
pick other element types and byte orders)."""
from __future__ import annotations

import base64
import itertools
import struct
import sys
import time
from dataclasses import dataclass

from engine.classifier import Classifier
from engine.errors import InvalidRequestError
from engine.pooling import PoolerConfig, PoolingParams
from engine.sampling_params import SamplingParams
from router.errors import bad_request, from_invalid_request
from router.protocol import EmbeddingRequest, PoolingFields


def embedding_params(req: PoolingFields, pooler: PoolerConfig | None, api: str = "Embeddings",
                     dimensions: int | None = None, task: str = "embed", task_param: str = "model") -> SamplingParams:
    """`pooler`: the engine's PoolerConfig (from its info), None where it generates: a 400, as
    vLLM's server answers a generative model's /v1/embeddings (`api`: the API the route serves);
    `task`: the pooling task it asks for, a 400 naming `task_param` where the model pools for others."""
    if pooler is None:
        raise bad_request(f"The model does not support the {api} API: it is served for generation (start the "
                          "server with --runner pooling to serve embeddings)", param="model")
    if task not in pooler.tasks:
        kind = "an embedding model" if pooler.classifier is None else pooler.classifier.kind
        raise bad_request(f"Task {task} is not supported by this model ({api} API): it is {kind}, which pools for "
                          f"{', '.join(pooler.tasks)}", param=task_param)
    try:
        params = pooler.resolved(PoolingParams(dimensions, req.use_activation, task=task))
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None
    sampling = params.sampling()
    sampling.priority, sampling.cache_salt = req.priority, req.cache_salt
    return sampling


@dataclass(frozen=True)
class BinaryReply:
    """vLLM's `encoding_format` "bytes" (or "bytes_only") reply: the vectors' bytes one after
    another as the body, and what each is (its byte range, shape, type) in a `metadata` header
    (none for bytes_only). router.api answers it as application/octet-stream."""
    body: bytes
    metadata: dict | None


def embedding_response(rid: str, model: str, vectors: list[list[float]], num_prompt_tokens: int,
                       req: EmbeddingRequest, kind: str = "embedding") -> dict | BinaryReply:
    """OpenAI's reply to /v1/embeddings; `kind` "pooling": vLLM's to /pooling (each vector under
    `data`, as a "pooling" object)."""
    created, usage = int(time.time()), {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
    if req.encoding_format in ("bytes", "bytes_only"):
        chunks = [packed(v, req.embed_dtype, req.endianness) for v in vectors]
        ends = list(itertools.accumulate(map(len, chunks)))
        items = [{"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness, "start": end - len(c),
                  "end": end, "shape": [len(v), len(v[0])] if v and isinstance(v[0], list) else [len(v)]}
                 for i, (v, c, end) in enumerate(zip(vectors, chunks, ends))]
        metadata = {"id": rid, "created": created, "model": model, "data": items, "usage": usage}
        return BinaryReply(b"".join(chunks), None if req.encoding_format == "bytes_only" else metadata)
    field = "embedding" if kind == "embedding" else "data"
    data = [{"index": i, "object": kind,
             field: as_base64(v, req.embed_dtype, req.endianness) if req.encoding_format == "base64" else v}
            for i, v in enumerate(vectors)]
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data, "usage": usage}


def classification_response(rid: str, model: str, probs: list[list[float]], head: Classifier,
                            num_prompt_tokens: int) -> dict:
    """vLLM's reply to /classify: each input's probabilities, and the label of the likeliest class."""
    data = [{"index": i, "label": head.label(p), "probs": p, "num_classes": len(p)} for i, p in enumerate(probs)]
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens, "completion_tokens": 0}}


def as_base64(vector: list, embed_dtype: str = "float32", endianness: str = "native") -> str:
    return base64.b64encode(packed(vector, embed_dtype, endianness)).decode("ascii")


def packed(vector: list, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """The values as `embed_dtype`s (vLLM's: float32, float16, bfloat16, fp8_e4m3, fp8_e5m2) in
    `endianness` byte order (native: this host's); a token classifier's rows one after another,
    as vLLM flattens them."""
    flat = [x for row in vector for x in row] if vector and isinstance(vector[0], list) else vector
    order = sys.byteorder if endianness == "native" else endianness
    if embed_dtype == "float32":
        return struct.pack(f"{'<' if order == 'little' else '>'}{len(flat)}f", *flat)
    import torch  # here only: the ingress imports no torch for float32 replies

    dtype, view = {"float16": (torch.float16, torch.int16), "bfloat16": (torch.bfloat16, torch.int16),
                   "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
                   "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}[embed_dtype]
    array = torch.tensor(flat, dtype=torch.float32).to(dtype).view(view).numpy()
    if order != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()
