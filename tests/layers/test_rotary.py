"""Rotary embeddings vs HF's LlamaRotaryEmbedding + apply_rotary_pos_emb for every scaling type."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.layers.rotary import get_rope, rope_parameters_from_config

HEAD_DIM = 32
NUM_HEADS = 2
MAX_POSITIONS = 4096

ROPE_PARAMETERS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


def _config(rope: dict, max_positions: int = MAX_POSITIONS, theta: float = 10000.0) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=1,
                       max_position_embeddings=max_positions, rope_parameters=dict(rope, rope_theta=theta))


def _hf_rotate(config: LlamaConfig, rotary: LlamaRotaryEmbedding, positions: torch.Tensor,
               query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF layout: [batch, heads, seq, head_dim]; our layout: [tokens, heads * head_dim]."""
    q = query.view(1, -1, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k = key.view(1, -1, 1, HEAD_DIM).transpose(1, 2)
    cos, sin = rotary(q, positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q.transpose(1, 2).reshape(query.shape), k.transpose(1, 2).reshape(key.shape)


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(num_tokens, NUM_HEADS * HEAD_DIM, generator=generator),
            torch.randn(num_tokens, HEAD_DIM, generator=generator))


@pytest.mark.parametrize("name", sorted(ROPE_PARAMETERS))
def test_matches_hf_up_to_4k_positions(name: str) -> None:
    config = _config(ROPE_PARAMETERS[name], theta=500000.0 if name == "llama3" else 10000.0)
    ours = get_rope(HEAD_DIM, config.max_position_embeddings, rope_parameters_from_config(config))
    positions = torch.cat([torch.arange(64), torch.randint(64, MAX_POSITIONS, (192,),
                                                           generator=torch.Generator().manual_seed(1)),
                           torch.tensor([MAX_POSITIONS - 1])])
    query, key = _inputs(len(positions))
    expected_query, expected_key = _hf_rotate(config, LlamaRotaryEmbedding(config), positions, query, key)
    actual_query, actual_key = ours(positions, query.clone(), key.clone())
    torch.testing.assert_close(actual_query, expected_query, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual_key, expected_key, atol=1e-5, rtol=1e-5)


def test_dynamic_ntk_matches_hf_within_and_beyond_original_context() -> None:
    original, factor = 512, 2.0
    config = _config({"rope_type": "dynamic", "factor": factor}, max_positions=original)
    ours = get_rope(HEAD_DIM, original, rope_parameters_from_config(config))
    assert ours.max_positions == int(original * factor)
    # Within the original context HF keeps plain RoPE for a whole sequence.
    positions = torch.arange(original)
    query, key = _inputs(original)
    expected = _hf_rotate(config, LlamaRotaryEmbedding(config), positions, query, key)
    actual = ours(positions, query.clone(), key.clone())
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # Beyond it, HF decoding one token at a time (seq_len = position + 1) gives the per-position table.
    hf_rotary = LlamaRotaryEmbedding(config)
    for position in [original, original + 1, original + 77, 2 * original - 1]:
        positions = torch.tensor([position])
        query, key = _inputs(1)
        expected = _hf_rotate(config, hf_rotary, positions, query, key)
        actual = ours(positions, query.clone(), key.clone())
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_accepts_three_dimensional_heads_layout() -> None:
    rotary = get_rope(HEAD_DIM, 128, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(10)
    query, key = _inputs(10)
    flat = rotary(positions, query, key)
    shaped = rotary(positions, query.view(10, NUM_HEADS, HEAD_DIM), key.view(10, 1, HEAD_DIM))
    torch.testing.assert_close(shaped[0].reshape(10, -1), flat[0])
    torch.testing.assert_close(shaped[1].reshape(10, -1), flat[1])


def test_legacy_rope_scaling_config_is_understood() -> None:
    class LegacyConfig:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_parameters_from_config(LegacyConfig()) == {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1234.0}


def test_rejects_unknown_rope_type_and_out_of_range_positions() -> None:
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        get_rope(HEAD_DIM, 128, {"rope_type": "longrope", "rope_theta": 10000.0})
    rotary = get_rope(HEAD_DIM, 16, {"rope_type": "default", "rope_theta": 10000.0})
    query, key = _inputs(1)
    with pytest.raises(ValueError, match="position 16 is beyond the rotary table"):
        rotary(torch.tensor([16]), query, key)
