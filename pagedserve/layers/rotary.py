"""Rotary position embeddings (RoPE) with the HF scaling types: default, linear, dynamic, llama3, yarn.

Each variant is defined by a per-position table of cos/sin (float32, [max_positions, head_dim // 2]
each), built once; `forward` gathers rows by position and rotates query and key in the "neox" layout
(first half / second half of each head, HF's `rotate_half`).

Dynamic NTK: HF recomputes the frequencies from the running sequence length. In an engine with a KV
cache, keys are rotated once when written, so a token's rotation can only depend on its own position.
We use the base HF derives for a sequence ending at that position: positions below the original
context keep plain RoPE (identical to HF for any sequence within the original context), and position
p beyond it uses seq_len = p + 1 (identical to HF's decoding one token at a time with its cache).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """The rope dict of an HF config, in transformers 5 form: {'rope_type', 'rope_theta', ...scaling keys}.

    Accepts both `config.rope_parameters` (transformers >= 5) and the older `rope_scaling` + `rope_theta`.
    """
    parameters = getattr(hf_config, "rope_parameters", None)
    if parameters is None:
        parameters = dict(getattr(hf_config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    parameters = dict(parameters)
    if "type" in parameters and "rope_type" not in parameters:  # older spelling
        parameters["rope_type"] = parameters.pop("type")
    parameters.setdefault("rope_type", "default")
    parameters.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return parameters


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def _llama3_inv_freq(head_dim: int, base: float, parameters: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(head_dim, base)
    factor = float(parameters["factor"])
    low_freq_factor = float(parameters["low_freq_factor"])
    high_freq_factor = float(parameters["high_freq_factor"])
    old_context_len = float(parameters["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq_and_scale(head_dim: int, base: float, parameters: dict[str, Any],
                             max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = int(parameters["original_max_position_embeddings"])
    factor = parameters.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        coefficient, coefficient_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if coefficient and coefficient_all_dim:
            attention_factor = mscale(factor, coefficient) / mscale(factor, coefficient_all_dim)
        else:
            attention_factor = mscale(factor)
    beta_fast = parameters.get("beta_fast") or 32
    beta_slow = parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over the original context.
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(CustomOp):
    """RoPE for `head_dim`-sized heads from a precomputed float32 cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, freqs: torch.Tensor, attention_scaling: float = 1.0,
                 rope_type: str = "default") -> None:
        """`freqs`: [max_positions, head_dim // 2] float32 angles (position times inverse frequency)."""
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_type = rope_type
        self.attention_scaling = attention_scaling
        cos = freqs.cos() * attention_scaling
        sin = freqs.sin() * attention_scaling
        # Non-persistent: derived from the config, never read from or written to checkpoints.
        self.cos_sin_cache: torch.Tensor
        # Tables are computed on the CPU (deterministic) and moved to the device the model is built on.
        cache = torch.cat([cos, sin], dim=-1).to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # The positions tensor the native path last range-checked (same identity memo as `_memo`).
        self._checked_positions: torch.Tensor | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, head_dim] (halves repeated, as in HF) for the given positions.

        One module is shared by every layer and each layer passes the same `positions` tensor, so the
        tables are gathered once per forward: the result is memoised on the tensor's identity. The model
        calls `clear_memo()` at the start of every forward, so a positions buffer updated in place
        between forwards (graph replay) is never served stale tables.
        """
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return memo[2], memo[3]
        self.check_positions(positions)
        cos, sin = self.cos_sin_cache.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)
        cos = torch.cat([cos, cos], dim=-1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).to(dtype)
        self._memo = (positions, dtype, cos, sin)
        return cos, sin

    def check_positions(self, positions: torch.Tensor) -> None:
        """ValueError when a position is beyond the table."""
        # Checked on the CPU only: on an accelerator the check would cost a device->host sync. Not in a
        # captured graph either (a data-dependent branch); the scheduler keeps positions < max_model_len.
        if positions.device.type == "cpu" and not torch.compiler.is_compiling() and positions.numel() \
                and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the rotary table "
                             f"(max_positions={self.max_positions})")

    def clear_memo(self) -> None:
        self._memo = None
        self._checked_positions = None

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` [num_tokens, num_heads * head_dim] (or [..., num_heads, head_dim]) and `key` alike."""
        cos, sin = self.cos_sin(positions, query.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One native kernel (kernels/cpu/elementwise.cpp) reading the cos/sin rows in place, instead of
        forward_native's gather, casts and ~10 ops per tensor; bitwise equal to forward_native (same rounding
        points: cos/sin rounded to the dtype, each product and the sum rounded). Reads query/key views with
        their row strides (qkv.split slices) and returns new contiguous tensors. Per token, so batch
        invariant (kept on under batch_invariant=True). forward_native when the inputs do not qualify."""
        if native_elementwise.qualifies(query) and native_elementwise.matches(key, query) \
                and positions.dtype in native_elementwise.POSITION_DTYPES \
                and self.cos_sin_cache.dtype == torch.float32:
            # Every layer passes the same positions tensor: range-check it once per forward (the kernel
            # checks each position too, but raises RuntimeError; this keeps forward_native's ValueError).
            if self._checked_positions is not positions:
                self.check_positions(positions)
                self._checked_positions = positions
            return native_elementwise.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim)
        return self.forward_native(positions, query, key)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        half = self.head_dim // 2
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated_half * sin).reshape(shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, rope_type={self.rope_type}"


def get_rope(head_dim: int, max_position_embeddings: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """Build the rotary embedding for an HF rope dict (see `rope_parameters_from_config`)."""
    rope_type = rope_parameters.get("rope_type", "default")
    base = float(rope_parameters.get("rope_theta", 10000.0))
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope_parameters['partial_rotary_factor']} is not supported; "
                         f"only full-head rotary (1.0)")
    positions = torch.arange(max_position_embeddings, dtype=torch.float32, device="cpu")
    attention_scaling = 1.0
    if rope_type == "default":
        freqs = torch.outer(positions, _default_inv_freq(head_dim, base))
    elif rope_type == "linear":
        freqs = torch.outer(positions, _default_inv_freq(head_dim, base) / float(rope_parameters["factor"]))
    elif rope_type == "llama3":
        freqs = torch.outer(positions, _llama3_inv_freq(head_dim, base, rope_parameters))
    elif rope_type == "yarn":
        inv_freq, attention_scaling = _yarn_inv_freq_and_scale(head_dim, base, rope_parameters,
                                                               max_position_embeddings)
        freqs = torch.outer(positions, inv_freq)
    elif rope_type == "dynamic":
        factor = float(rope_parameters["factor"])
        original = max_position_embeddings
        # The table extends to factor x the original context (the reach dynamic scaling is meant for).
        max_positions = int(original * factor)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        seq_lens = torch.clamp(positions + 1, min=original)
        bases = base * ((factor * seq_lens / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        inv_freq = 1.0 / (bases.unsqueeze(-1) ** exponents)
        # Within the original context the base is exactly `base`; use the plain table there so the
        # numbers are bit-identical to default RoPE.
        inv_freq[:original] = _default_inv_freq(head_dim, base)
        freqs = positions.unsqueeze(-1) * inv_freq
        return RotaryEmbedding(head_dim, max_positions, freqs, 1.0, rope_type)
    else:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    return RotaryEmbedding(head_dim, max_position_embeddings, freqs, attention_scaling, rope_type)


__all__ = ["RotaryEmbedding", "SUPPORTED_ROPE_TYPES", "get_rope", "rope_parameters_from_config"]
