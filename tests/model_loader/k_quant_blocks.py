"""Round-to-nearest Q4_K, Q5_K and Q6_K blocks for test files (gguf-py dequantizes K-quants but does not quantize
them). Any bytes are valid blocks, so the tests' oracle is the dequantization (model_loader/gguf_dequant.py,
bitwise gguf-py's), not this quantizer; it only gives the tiny models weights near their float values, so that their
logits spread as the other test files' do."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

SUPER_BLOCK = 256


def _float16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _packed_scales_and_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block [n, 8] as Q4_K's 12 bytes: bytes 0-3 the low six bits of scales 0-3
    under the top two bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low nibbles of scales 4-7
    under those of mins 4-7."""
    packed = np.zeros((len(scales), 12), np.uint8)
    packed[:, 0:4] = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return packed


def _quantize_q4_k_or_q5_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    num_blocks, top = len(blocks), (1 << bits) - 1
    sub = blocks.reshape(num_blocks, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d = _float16(scale.max(-1) / 63)
    dmin = _float16((-low).max(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 != 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 != 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    offset = (dmin32 * m)[..., None]
    q = np.clip(np.round(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step != 0)), 0, top)
    q = q.astype(np.uint8)  # [n, 8, 32]
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # [n, 4, 32]: sub-blocks 2c (low) and 2c + 1 (high)
    parts = [d.view(np.uint8).reshape(num_blocks, 2), dmin.view(np.uint8).reshape(num_blocks, 2),
             _packed_scales_and_mins(sc, m)]
    if bits == 5:  # bit j of qh[l]: the fifth bit of value l of sub-block j
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    parts.append(nibbles.reshape(num_blocks, 128))
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    num_blocks = len(blocks)
    sub = blocks.reshape(num_blocks, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _float16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 != 0)), -128, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)) + 32, 0, 63)
    q = q.astype(np.uint8).reshape(num_blocks, 2, 4, 32)  # half, t (value 128 half + 32 t + l), l
    low = q & 15
    ql = np.concatenate((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), axis=2)
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate((ql.reshape(num_blocks, 128), qh.reshape(num_blocks, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(num_blocks, 2)), axis=1)


def quantize_k(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """float32 values [rows, K] (K a multiple of 256) as uint8 [rows, K / 256 * block bytes] of `ggml_type` blocks."""
    rows, k = values.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"a {ggml_type.name} row of {k} values is not a whole number of 256-value blocks")
    blocks = values.astype(np.float32).reshape(-1, SUPER_BLOCK)
    if ggml_type == GGMLQuantizationType.Q6_K:
        raw = _quantize_q6_k(blocks)
    elif ggml_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        raw = _quantize_q4_k_or_q5_k(blocks, 4 if ggml_type == GGMLQuantizationType.Q4_K else 5)
    else:
        raise ValueError(f"{ggml_type.name} is not a K-quant type")
    return raw.reshape(rows, -1)
