"""The model runner of the CUDA path: Triton attention over the paged pool, step inputs built once
per step in pinned buffers, and CUDA graphs for decode-only steps (engine.cuda_graphs).

It runs wherever Triton does, so the tests drive it on CPU under Triton's interpreter (no graphs
there). The CPU engine keeps engine.model_runner.ModelRunner and its C kernels.
"""
from __future__ import annotations

import logging

import torch

from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.lora import adapters_of
from engine.model.llama import LlamaModel
from engine.model_runner import ModelRunner, RunnerOutput, sampled_output
from engine.scheduler import ScheduledBatch
from engine.step_inputs import StepInputs, StepLayout

logger = logging.getLogger(__name__)


class TritonModelRunner(ModelRunner):
    """Same contract as ModelRunner.execute: logits of the sampling rows (row order of
    batch.sampled) and of the prompt-logprob rows."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_speculative_tokens: int = 0, graph_sizes: tuple[int, ...] | None = None,
                 max_graph_size: int | None = None) -> None:
        """`num_speculative_tokens`: the drafts a sequence may run per step, each its own decode row.
        `graph_sizes`, `max_graph_size`: vLLM's cudagraph_capture_sizes and max_cudagraph_capture_size."""
        super().__init__(model, kv_caches, block_size, device)
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.inputs = StepInputs(max_tokens, min(max_tokens, max_num_seqs * (1 + num_speculative_tokens)),
                                 -(-max_model_len // block_size), block_size, device)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.graph_sizes = capture_sizes(graph_sizes, max_graph_size, max_num_seqs, self.inputs.max_seqs)
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()  # as execute() replays them
    def capture_graphs(self) -> list[int]:
        """Capture one decode graph per batch-size bucket (CUDA only); -> the bucket sizes, none
        when CUDA refused a capture: the engine then runs every step eagerly, as with
        --enforce-eager, and says so (a capture fault must not keep the engine from serving)."""
        if not self.graph_sizes:
            return []
        try:
            self.graphs = DecodeGraphs(self._graph_setup, lambda size: self._forward(self._decode_layout(size)),
                                       self.graph_sizes)
        except RuntimeError as e:
            logger.warning("CUDA graph capture failed, so decode steps run eagerly (--enforce-eager skips the "
                           "capture): %s", " ".join(str(e).split())[:500])
            self.graphs = None
            return []
        return self.graph_sizes

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step (the token budget, as long sequences) and its logits, on whatever the
        pool holds: run once so that the peak memory of a step can be measured."""
        layout = self.inputs.fill_profile(self.inputs.max_tokens, self.max_model_len)
        self.inputs.upload(layout)
        hidden = self._forward(layout)
        sampled_output(self.model, hidden.index_select(0, self.inputs.logit_rows(layout, 0, layout.sample_rows)),
                       layout.sampled)

    def _graph_setup(self, size: int) -> None:
        """Padding rows (slot -1, empty context) in the static buffers: warm-up and capture run
        the model on them and write nothing to the pool."""
        self.inputs.fill_padding(size)
        self.inputs.upload(self._decode_layout(size))
        torch.cuda.synchronize()

    @staticmethod
    def _decode_layout(size: int) -> StepLayout:
        return StepLayout(size, size, 0, 0, 0, [])

    def _forward(self, layout: StepLayout) -> torch.Tensor:
        n = layout.num_tokens
        return self.model(self.inputs.input_ids(n), self.inputs.positions_dev(n), self.kv_caches,
                          self.inputs.attention(layout))  # (n, hidden)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self._copy_blocks(batch.copies)
        adapters, adapted = adapters_of(self.model, batch, self.block_size, self.device)
        size = None if adapted else self._graph_size(batch)  # the graphs know no adapters
        layout = self.inputs.fill(batch, pad_to=size)
        self.inputs.upload(layout)
        if size is not None and layout.prompt_rows == 0:
            hidden = self.graphs.replay(size)  # (size, hidden), static output
        else:
            with adapters:
                hidden = self._forward(layout)
        rows = self.inputs.logit_rows(layout, 0, layout.sample_rows)
        out = sampled_output(self.model, hidden.index_select(0, rows), layout.sampled)
        if layout.prompt_rows:
            prompt_rows = self.inputs.logit_rows(layout, layout.sample_rows, layout.prompt_rows)
            out.prompt_rows = self._prompt_rows(hidden.index_select(0, prompt_rows))
            out.prompt_spans = layout.prompt_spans
        return out

    def _graph_size(self, batch: ScheduledBatch) -> int | None:
        """The captured batch size this step replays at, or None to run eagerly. A decode with
        drafts (engine.speculative) is decode rows too: a step of decodes replays at its rows."""
        if self.graphs is None or batch.num_prefill_chunks:
            return None
        return self.graphs.size_for(batch.num_tokens)
