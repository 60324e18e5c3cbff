"""kvserve's paged-KV continuous-batching inference engine (no Ray, no HTTP)."""
from engine.beam_search import BeamSearchParams
from engine.config import EngineConfig
from engine.inputs import PromptType, TextPrompt, TokensPrompt
from engine.lora_request import LoRARequest
from engine.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, EngineStats, Logprob,
                            PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from engine.pooling import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncEngine", "ProcessEngine", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput", "Logprob",
           "CompletionOutput", "EngineStats", "BeamSearchParams", "LoRARequest", "PoolingParams", "PoolingOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "TextPrompt", "TokensPrompt", "PromptType", "__version__"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for SamplingParams) must not load torch models.
    if name == "__version__":
        from engine.version import kvserve_version
        return kvserve_version()
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "ProcessEngine":
        from engine.process_engine import ProcessEngine
        return ProcessEngine
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
