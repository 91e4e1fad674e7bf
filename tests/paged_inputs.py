"""Test helper: drive a pagedserve model over a scratch paged KV cache without the engine.

`ScratchPagedRunner` plays a minimal model runner: it hands out blocks per request (block 0 stays the
null block), builds the step's AttentionMetadata from how many tokens each request adds, and runs the
model inside the forward context. Tests use it to check models and attention against HF.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.worker.kv_cache_allocation import attention_layers


def build_attention_metadata(num_new_tokens: list[int], num_computed_tokens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step plus the positions of its tokens (requests in the given order)."""
    query_start_loc = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for new, computed, blocks in zip(num_new_tokens, num_computed_tokens, block_tables):
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(computed + new)
        for position in range(computed, computed + new):
            positions.append(position)
            slots.append(blocks[position // block_size] * block_size + position % block_size)
    max_num_blocks = max(len(blocks) for blocks in block_tables)
    table = torch.zeros(len(block_tables), max_num_blocks, dtype=torch.int32)
    for row, blocks in enumerate(block_tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    num_decodes = 0
    for new in num_new_tokens:
        if new != 1:
            break
        num_decodes += 1
    metadata = AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        max_query_len=max(num_new_tokens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return metadata, torch.tensor(positions, dtype=torch.int64, device=device)


class ScratchPagedRunner:
    """Runs `model` step by step over its own paged KV cache (one tensor per Attention layer)."""

    def __init__(self, model: nn.Module, block_size: int = 16, num_blocks: int = 64,
                 dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Every attention layer (dense or MLA) gets a cache of the shape its kv_cache_spec() declares.
        layers = attention_layers(model)
        # The model dtype: the first float parameter (GGUF blocks kept quantized are uint8).
        parameter = next(parameter for parameter in model.parameters() if parameter.is_floating_point())
        def allocate_zeros(shape: tuple[int, ...], zeros_dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=zeros_dtype, device=parameter.device)

        # Through the spec's page layout, so that layers with extra components (DSA's index keys) get them too.
        for layer in layers:
            layout = layer.kv_cache_spec().page_layout(block_size, dtype or parameter.dtype)
            layer.kv_cache = layout.allocate(num_blocks, allocate_zeros)
        # Blocks are handed out in a scrambled order so tables are not trivially contiguous.
        self._free_blocks = list(range(num_blocks - 1, 0, -1))
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed_tokens: dict[str, int] = {}

    @torch.no_grad()
    def step(self, new_token_ids: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Add the given tokens to each request; return float32 logits [num_new, vocab] per request."""
        request_ids = list(new_token_ids)
        num_new = [len(new_token_ids[request_id]) for request_id in request_ids]
        computed = [self.num_computed_tokens.get(request_id, 0) for request_id in request_ids]
        tables = []
        for request_id, new, done in zip(request_ids, num_new, computed):
            table = self.block_tables.setdefault(request_id, [])
            while len(table) * self.block_size < done + new:
                table.append(self._free_blocks.pop())
            tables.append(table)
        device = next(self.model.parameters()).device
        metadata, positions = build_attention_metadata(num_new, computed, tables, self.block_size, device)
        input_ids = torch.tensor([t for request_id in request_ids for t in new_token_ids[request_id]],
                                 dtype=torch.int64, device=device)
        with set_forward_context(metadata):
            hidden_states = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden_states)
        outputs = {}
        for index, request_id in enumerate(request_ids):
            start, end = metadata.query_start_loc_cpu[index], metadata.query_start_loc_cpu[index + 1]
            outputs[request_id] = logits[start:end]
            self.num_computed_tokens[request_id] = computed[index] + num_new[index]
        return outputs
