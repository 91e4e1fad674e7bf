"""MLA: the latent paged cache (spec, sizing, allocation), absorbed decode == expansion, and DeepSeek
logits over a scratch paged cache (chunked prefill + decodes) equal to HF's full forward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from paged_inputs import ScratchPagedRunner
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.attention.mla_paged import attend_absorbed_decodes, attend_expanded, write_latent_to_cache
from pagedserve.config.model import ModelConfig
from pagedserve.layers.attention import Attention
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.mla_attention import MLAAttention
from pagedserve.model_loader import load_model
from pagedserve.platforms import current_platform
from pagedserve.worker.kv_cache_allocation import allocate_kv_caches, attention_layers, kv_bytes_per_block

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 20


def test_absorbed_decode_equals_expanded_attention() -> None:
    generator = torch.Generator().manual_seed(0)
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3
    block_size, num_blocks = 4, 16
    cache = torch.zeros(num_blocks, block_size, RANK + ROPE)
    seq_lens = [7, 1, 13]
    tables = torch.tensor([[3, 5, 0, 0], [9, 0, 0, 0], [1, 2, 4, 6]], dtype=torch.int32)
    latents = []
    for row, seq_len in enumerate(seq_lens):
        latent = torch.randn(seq_len, RANK + ROPE, generator=generator)
        slots = torch.tensor([int(tables[row, p // block_size]) * block_size + p % block_size
                              for p in range(seq_len)])
        write_latent_to_cache(latent, cache, slots)
        latents.append(latent)
    q_nope = torch.randn(3, HEADS, NOPE, generator=generator)
    q_pe = torch.randn(3, HEADS, ROPE, generator=generator)
    absorbed = attend_absorbed_decodes(q_nope, q_pe, cache, tables, seq_lens, kv_b, RANK, V, 0.3)
    for row, latent in enumerate(latents):
        # The decode token is the last of its context: expansion over the whole context, last query row.
        expanded = attend_expanded(q_nope[row:row + 1], q_pe[row:row + 1], latent, kv_b, RANK, V, 0.3)
        torch.testing.assert_close(absorbed[row], expanded[0], atol=1e-5, rtol=1e-5)


class _MixedLayers(nn.Module):
    """A toy model whose two attention layers need different cache specs."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = Attention(4, 8, 0.1, num_kv_heads=2, prefix="dense")
        self.mla = MLAAttention(HEADS, NOPE, ROPE, V, RANK, 0.1, ColumnParallelLinear(RANK, HEADS * (NOPE + V)),
                                prefix="mla")


def test_kv_cache_spec_sizes_and_allocates_each_layer_by_its_own_shape() -> None:
    model = _MixedLayers()
    assert [type(layer) for layer in attention_layers(model)] == [Attention, MLAAttention]
    assert model.dense.kv_cache_spec() == KVCacheSpec(per_token_shape=(2, 8), leading_shape=(2,), supports_int8=True)
    assert model.mla.kv_cache_spec() == KVCacheSpec(per_token_shape=(RANK + ROPE,), supports_int8=True,
                                                    latent_rank=RANK)
    block_size = 16
    # dense: 2 * 2 heads * 8 dims; MLA: one latent row of RANK + ROPE; float32 = 4 bytes.
    assert kv_bytes_per_block(model, block_size, torch.float32) == block_size * 4 * (2 * 2 * 8 + RANK + ROPE)
    caches = allocate_kv_caches(model, 10, block_size, torch.float32, current_platform())
    assert [tuple(c.shape) for c in caches] == [(2, 10, block_size, 2, 8), (10, block_size, RANK + ROPE)]
    assert sum(c.numel() * c.element_size() for c in caches) == 10 * kv_bytes_per_block(model, block_size,
                                                                                         torch.float32)


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_deepseek_latent_cache_logits_equal_hf_forward(tiny_model_dir, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(kind)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = ModelConfig(model=folder, dtype=torch.float32, hf_config=hf_model.config)
    model = load_model(config, "cpu")
    layers = attention_layers(model)
    assert all(isinstance(layer, MLAAttention) for layer in layers) and len(layers) == 2
    # Per token the cache holds kv_lora_rank + qk_rope_head_dim values, not 2 * heads * head_dim.
    assert layers[0].kv_cache_spec().per_token_shape == (16 + 8,)
    tokens = torch.randint(8, hf_model.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf_model(tokens).logits[0]
    runner = ScratchPagedRunner(model, block_size=16, num_blocks=16)
    ids = tokens[0].tolist()
    # Chunked prefill (the second chunk reads the first from the latent cache), then single-token decodes
    # batched with another request's prefill.
    got = [runner.step({"a": ids[:20]})["a"], runner.step({"a": ids[20:40]})["a"]]
    for position in range(40, 45):
        outputs = runner.step({"a": [ids[position]], "b": ids[:3] if position == 40 else [ids[position]]})
        got.append(outputs["a"])
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-4, rtol=2e-4)
