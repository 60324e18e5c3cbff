"""The model runner of an encoder (engine.model.bert): every sequence of a step is a whole prompt
(the engine runs encoders without chunked prefill or prefix caching), and each gives one pooled
row. There is no KV cache to write or read; the blocks the scheduler hands out only count."""
from __future__ import annotations

import torch

from engine.device_copy import to_device
from engine.model.bert import EncoderModel
from engine.model_runner import RunnerOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


def encoder_blocks(config, max_model_len: int) -> int:
    """The pool the scheduler counts for an encoder: enough for any step's prompts (at most the
    step budget, which holds a max_model_len prompt: engine.llm_engine.encoder_config), a
    part-filled block each."""
    bs = config.block_size
    return -(-max(config.max_num_batched_tokens, max_model_len) // bs) + config.max_num_seqs


class EncoderRunner:
    def __init__(self, model: EncoderModel, pooling_type: str, block_size: int, device: torch.device) -> None:
        self.model = model
        self.pooling_type = pooling_type
        self.block_size = block_size
        self.device = device

    def token_types(self, seq: Sequence) -> list[int]:
        """A cross-encoder pair's: 1 from where its second text begins (BERT's pair encoding,
        [CLS] a [SEP] b [SEP], gives b's tokens the second type; engine.scoring.pair_prompts
        says where), as the tokenizer's token_type_ids; 0 for every other token and prompt."""
        n = seq.num_prompt_tokens
        start = seq.params.pooling.token_type_start
        if start is None or start >= n or self.model.arch.type_vocab_size < 2:
            return [0] * n
        return [0] * start + [1] * (n - start)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        # by length: prompts of one length are then consecutive, and attend as one batch
        # (engine.model.bert.per_prompt_attention); the pooled rows come back in this order
        order = sorted(batch.row_order(self.block_size), key=lambda i: batch.seqs[i].num_prompt_tokens)
        ids, types, lens, every_token = [], [], [], []
        for i in order:
            seq = batch.seqs[i]
            if seq.num_computed_tokens or batch.num_new_tokens[i] != seq.num_prompt_tokens:
                raise RuntimeError(f"an encoder runs whole prompts: sequence {seq.request_id} was scheduled "
                                   f"{batch.num_new_tokens[i]} of its {seq.num_prompt_tokens} tokens from "
                                   f"{seq.num_computed_tokens}")
            ids.extend(seq.prompt_token_ids)
            types.extend(self.token_types(seq))
            lens.append(seq.num_prompt_tokens)
            every_token.append(seq.params.pooling.every_token)  # token_embed: every row, not the pooled one
        pooled = self.model(to_device(ids, torch.long, self.device), lens, to_device(types, torch.long, self.device),
                            self.pooling_type, every_token)
        return RunnerOutput(None, order, pooled=pooled)
