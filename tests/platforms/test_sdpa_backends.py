"""platforms/sdpa_backends.py: the math backend exactly where torch's CPU flash attention is broken (bfloat16 /
float16 CPU tensors on AMX hardware with ATen below AVX-512), torch's own choice everywhere else."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from pagedserve.platforms import sdpa_backends


@pytest.mark.parametrize("is_broken", [False, True])
def test_backends_follow_the_dtype_the_device_and_the_cpu(monkeypatch, is_broken: bool) -> None:
    monkeypatch.setattr(sdpa_backends, "cpu_flash_attention_is_broken", lambda: is_broken)
    float32, bfloat16 = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert isinstance(sdpa_backends.cpu_attention_backends(float32), contextlib.nullcontext)
    off_cpu = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16, device="meta")
    assert isinstance(sdpa_backends.cpu_attention_backends(off_cpu), contextlib.nullcontext)
    chosen = sdpa_backends.cpu_attention_backends(bfloat16)
    assert isinstance(chosen, contextlib.nullcontext) is not is_broken


def test_the_math_backend_computes_the_same_attention(monkeypatch) -> None:
    """Inside the forced context torch runs its math backend (same attention up to rounding) on a long bf16
    prefill, the shape whose flash path packs blocks."""
    monkeypatch.setattr(sdpa_backends, "cpu_flash_attention_is_broken", lambda: True)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, 1024, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    with sdpa_backends.cpu_attention_backends(query):
        forced = F.scaled_dot_product_attention(query, key, value, is_causal=True)
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=True)
    torch.testing.assert_close(forced.float(), reference, atol=2e-2, rtol=2e-2)
