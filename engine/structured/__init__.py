"""Constrained decoding with llguidance: specs, compiled grammars, per-sequence matchers, masks."""
from engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
