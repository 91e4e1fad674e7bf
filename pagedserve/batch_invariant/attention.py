"""Batch-invariant paged attention: torch_paged's cache layout and masking, with a fixed reduction order.

Why: torch_paged batches decodes into chunks padded to the chunk's longest context and attends prefill
chunks with one SDPA call each; the CPU SDPA kernel sizes its key blocks and GEMMs from the padded
length and the number of queries, so a token's attention output depends on the other requests in its
chunk and on how its own prompt was cut into chunks.

How: every query token is attended alone in the same fixed shapes, whatever the batch:
- a unit is one token's `group` query heads that share one KV head (GQA): a [group, head_dim] matrix;
- keys are read in tiles of KV_TILE positions aligned to absolute position 0 (tile j holds positions
  [j * KV_TILE, (j + 1) * KV_TILE)), always tiles 0, 1, 2, ... in order;
- per tile, scores = unit @ K_tile^T and P @ V_tile are `bmm` items of one fixed shape (each item's
  result depends neither on the number of items nor on its place among them: tests check it), and an
  online softmax folds the tile in (running max, rescaled sum and output);
- keys past the query (causal), past the context or outside the sliding window are masked to -inf, and
  the value rows past the context are zeroed, so a tile that is entirely masked for a query leaves its
  running state bit for bit unchanged (x * exp(0) + 0). A query therefore gets the same bits whether
  its request is alone, padded to a longer decode in a batch, or part of a longer prefill chunk.
Computed in float32 (bfloat16 K/V are widened), cast back to the query's dtype; exp runs on the vector
path for every element (elementwise.py).
Decodes are attended together (units of all decode requests in each bmm); each prefill chunk loops over
its KV heads and tiles with the tile broadcast to all its tokens (no copy per token).
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata

# torch_paged's own input checks, cache write and block gather: the layout and the rules stay one code.
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend, gather_blocks
from pagedserve.batch_invariant.dispatch_mode import outside_batch_invariant_mode
from pagedserve.batch_invariant.elementwise import vector_path_unary

# Key positions per tile. Part of the numerics (a different tile changes the last bits, never with the
# batch); 64 keeps a tile's [group, 64] scores and the elementwise ops on them whole vectors.
KV_TILE = 64


class OnlineSoftmax:
    """Running max / sum / output of one set of units over tiles folded in order.

    Units are rows of `group` query heads: state m, l [units, group], output [units, group, head_dim].
    """

    def __init__(self, num_units: int, group: int, head_dim: int, device: torch.device) -> None:
        self.max = torch.full((num_units, group), float("-inf"), dtype=torch.float32, device=device)
        self.sum = torch.zeros(num_units, group, dtype=torch.float32, device=device)
        self.output = torch.zeros(num_units, group, head_dim, dtype=torch.float32, device=device)

    def fold(self, query: torch.Tensor, key_t: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor) -> None:
        """query [U, group, D] (pre-scaled), key_t [U, D, T], value [U, T, D] (rows past the context zero),
        hidden: bool, broadcastable to [U, group, T], True where the key is masked."""
        scores = torch.bmm(query, key_t).masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(self.max, scores.amax(dim=-1))
        # A row that has seen no visible key yet keeps max -inf; use 0 there so exp(-inf - 0) = 0, not NaN.
        safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
        probabilities = vector_path_unary(torch.exp, scores - safe_max.unsqueeze(-1))
        rescale = vector_path_unary(torch.exp, self.max - safe_max)  # 1 when the max did not move; 0 from -inf
        self.sum = self.sum * rescale + probabilities.sum(dim=-1)
        self.output = self.output * rescale.unsqueeze(-1) + torch.bmm(probabilities, value)
        self.max = new_max

    def result(self) -> torch.Tensor:
        """[U, group, D]; every query sees at least itself, so the sum is positive."""
        return self.output / self.sum.unsqueeze(-1)


def _hidden_keys(key_positions: torch.Tensor, query_positions: torch.Tensor, seq_lens: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """True where a key is invisible to a query: after it, past the context, or outside the window."""
    hidden = (key_positions > query_positions) | (key_positions >= seq_lens)
    if sliding_window is not None:
        hidden |= key_positions <= query_positions - sliding_window
    return hidden


def _gather_tiles(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """K/V of positions [0, num_tiles * KV_TILE) of each row of `block_table`:
    [2, rows, num_tiles * KV_TILE, H_kv, D] (positions past a request's blocks read the null block 0)."""
    block_size = kv_cache.shape[2]
    num_positions = num_tiles * KV_TILE
    num_blocks = -(-num_positions // block_size)
    rows = block_table.shape[0]
    table = block_table.to(torch.long)
    if table.shape[1] < num_blocks:
        table = torch.nn.functional.pad(table, (0, num_blocks - table.shape[1]))
    blocks = gather_blocks(kv_cache, table[:, :num_blocks].reshape(-1))  # [2, rows*n, bs, H_kv, D]
    context = blocks.view(2, rows, num_blocks * block_size, *kv_cache.shape[3:])
    return context[:, :, :num_positions]


class BatchInvariantPagedAttentionBackend(TorchPagedAttentionBackend):
    """torch_paged with a batch-invariant reduction order (see the module docstring): the same K/V write
    and request loop, with both attention hooks replaced by the fixed-tile versions below."""

    name = "torch_paged_batch_invariant"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        # Invariant by construction: the step's dispatch mode (which would pad every bmm item to 16 rows and
        # reroute each small op through Python) is suspended here.
        with outside_batch_invariant_mode():
            return super().forward(query, key, value, kv_cache, metadata, scale, sliding_window)

    def _forward_decodes(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                         scale: float, sliding_window: int | None, output: torch.Tensor) -> None:
        num_decodes = metadata.num_decodes
        output[:num_decodes] = self._attend_decodes(query[:num_decodes], kv_cache, metadata, scale, sliding_window)

    def _forward_request(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                         sliding_window: int | None) -> torch.Tensor:
        # The context is always read back from the cache in fixed tiles (never this step's K/V directly), so
        # how a prompt is cut into chunks cannot change the reduction order.
        start, end = metadata.query_start_loc_cpu[index], metadata.query_start_loc_cpu[index + 1]
        return self._attend_request(query[start:end], kv_cache, metadata, index, scale, sliding_window)

    @staticmethod
    def _attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                        sliding_window: int | None) -> torch.Tensor:
        """The first num_decodes requests (one query each), all units in each bmm. [B, H, D] -> [B, H, D]."""
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        device = query.device
        seq_lens_cpu = metadata.seq_lens_cpu[:num_decodes]
        num_tiles = -(-max(seq_lens_cpu) // KV_TILE)
        context = _gather_tiles(kv_cache, metadata.block_table[:num_decodes], num_tiles).float()
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.long, device=device)
        key_positions = torch.arange(num_tiles * KV_TILE, device=device)
        # Zero the value rows past each context: masked keys then add exactly nothing (0 * v).
        context[1].masked_fill_((key_positions[None, :] >= seq_lens[:, None])[:, :, None, None], 0.0)
        # [B, L, H_kv, D] -> per unit (request, KV head): [B * H_kv, tiles, T, D]
        keys = context[0].view(num_decodes, num_tiles, KV_TILE, num_kv_heads, head_dim).permute(0, 3, 1, 2, 4)
        values = context[1].view(num_decodes, num_tiles, KV_TILE, num_kv_heads, head_dim).permute(0, 3, 1, 2, 4)
        keys = keys.reshape(num_decodes * num_kv_heads, num_tiles, KV_TILE, head_dim)
        values = values.reshape(num_decodes * num_kv_heads, num_tiles, KV_TILE, head_dim)
        units = (query.float() * scale).view(num_decodes * num_kv_heads, group, head_dim)
        query_positions = (seq_lens - 1)[:, None]
        unit_seq_lens = seq_lens[:, None]
        state = OnlineSoftmax(num_decodes * num_kv_heads, group, head_dim, device)
        for tile in range(num_tiles):
            tile_positions = key_positions[tile * KV_TILE:(tile + 1) * KV_TILE][None, :]
            hidden = _hidden_keys(tile_positions, query_positions, unit_seq_lens, sliding_window)  # [B, T]
            hidden = hidden[:, None, None, :].expand(num_decodes, num_kv_heads, 1, KV_TILE)
            state.fold(units, keys[:, tile].transpose(1, 2), values[:, tile],
                       hidden.reshape(num_decodes * num_kv_heads, 1, KV_TILE))
        return state.result().view(num_decodes, num_heads, head_dim).to(query.dtype)

    @staticmethod
    def _attend_request(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, index: int,
                        scale: float, sliding_window: int | None) -> torch.Tensor:
        """One request's q_len new tokens (a prefill chunk). [q_len, H, D] -> [q_len, H, D]."""
        q_len, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        device = query.device
        seq_len = metadata.seq_lens_cpu[index]
        num_tiles = -(-seq_len // KV_TILE)
        context = _gather_tiles(kv_cache, metadata.block_table[index:index + 1], num_tiles)[:, 0].float()
        key_positions = torch.arange(num_tiles * KV_TILE, device=device)
        context[1][seq_len:] = 0.0  # value rows past the context add exactly nothing
        # [L, H_kv, D] -> [H_kv, tiles, T, D]
        keys = context[0].view(num_tiles, KV_TILE, num_kv_heads, head_dim).permute(2, 0, 1, 3).contiguous()
        values = context[1].view(num_tiles, KV_TILE, num_kv_heads, head_dim).permute(2, 0, 1, 3).contiguous()
        # [q_len, H, D] -> per KV head: [H_kv, q_len, group, D] (one unit per token)
        units = (query.float() * scale).view(q_len, num_kv_heads, group, head_dim).transpose(0, 1).contiguous()
        query_positions = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        seq_len_tensor = torch.tensor(seq_len, device=device)
        output = torch.empty(q_len, num_kv_heads, group, head_dim, dtype=torch.float32, device=device)
        for kv_head in range(num_kv_heads):
            state = OnlineSoftmax(q_len, group, head_dim, device)
            for tile in range(num_tiles):
                tile_positions = key_positions[tile * KV_TILE:(tile + 1) * KV_TILE][None, :]
                hidden = _hidden_keys(tile_positions, query_positions, seq_len_tensor, sliding_window)  # [q, T]
                # The tile is the same matrix for every token: broadcast (stride 0), never copied.
                key_t = keys[kv_head, tile].t().expand(q_len, head_dim, KV_TILE)
                value_tile = values[kv_head, tile].expand(q_len, KV_TILE, head_dim)
                state.fold(units[kv_head], key_t, value_tile, hidden[:, None, :])
            output[:, kv_head] = state.result()
        return output.view(q_len, num_heads, head_dim).to(query.dtype)


__all__ = ["KV_TILE", "BatchInvariantPagedAttentionBackend", "OnlineSoftmax"]
