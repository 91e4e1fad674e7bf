"""Vocabulary-parallel embedding / LM head, RMSNorm and SiluAndMul against plain formulas and HF."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.norm import RMSNorm

VOCAB, DIM = 150, 8


def _table() -> torch.Tensor:
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_vocab_parallel_embedding_shards_sum_to_the_full_lookup(tp_size: int) -> None:
    table = _table()
    input_ids = torch.tensor([0, 1, 63, 64, 75, 76, 127, 128, 149])
    total = torch.zeros(len(input_ids), DIM)
    for rank in range(tp_size):
        embedding = VocabParallelEmbedding(VOCAB, DIM, tp_rank=rank, tp_size=tp_size)
        assert embedding.num_embeddings_padded >= VOCAB and embedding.num_embeddings_per_partition % 64 == 0
        embedding.weight.weight_loader(embedding.weight, table)
        total += embedding(input_ids)  # the all-reduce is the identity in one process: sum by hand
    torch.testing.assert_close(total, F.embedding(input_ids, table))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_lm_head_shards_concatenate_to_the_full_logits(tp_size: int) -> None:
    table = _table()
    hidden = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    shards = []
    for rank in range(tp_size):
        head = ParallelLMHead(VOCAB, DIM, tp_rank=rank, tp_size=tp_size)
        head.weight.weight_loader(head.weight, table)
        shards.append(F.linear(hidden, head.weight))
    logits = torch.cat(shards, dim=-1)
    torch.testing.assert_close(logits[:, :VOCAB], hidden @ table.T)
    assert torch.all(logits[:, VOCAB:] == 0)  # padding rows are zero


def test_lm_head_compute_logits_is_float32_and_drops_padding() -> None:
    head = ParallelLMHead(VOCAB, DIM, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, _table())
    logits = head.compute_logits(torch.ones(2, DIM, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (2, VOCAB)


def test_embedding_rejects_wrong_checkpoint_shape() -> None:
    embedding = VocabParallelEmbedding(VOCAB, DIM, prefix="model.embed_tokens")
    with pytest.raises(ValueError, match=r"model.embed_tokens: checkpoint tensor has shape \(149, 8\)"):
        embedding.weight.weight_loader(embedding.weight, _table()[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_with_and_without_residual(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(DIM, generator=generator).to(dtype)
    x = torch.randn(5, DIM, generator=generator).to(dtype)
    residual = torch.randn(5, DIM, generator=generator).to(dtype)
    reference = LlamaRMSNorm(DIM, eps=1e-5).to(dtype)
    reference.weight.data.copy_(weight)
    ours = RMSNorm(DIM, eps=1e-5, params_dtype=dtype)
    ours.weight.weight_loader(ours.weight, weight)
    torch.testing.assert_close(ours(x), reference(x), atol=0, rtol=0)
    output, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(output, reference(x + residual), atol=0, rtol=0)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
