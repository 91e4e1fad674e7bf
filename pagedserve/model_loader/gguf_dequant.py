"""Dequantization of GGUF tensor payloads into float32 numpy arrays.

Every supported ggml type is decoded block-wise with whole-array numpy operations (no Python loop
over blocks). The arithmetic follows ggml's reference decoders (`dequantize_row_*` in
ggml-quants.c) operation for operation, in float32 and without fused multiply-adds, so the result
is bit-identical to llama.cpp's CPU reference and to `gguf.quants.dequantize`.

Block layouts (little-endian; `half` is IEEE float16; QK_K = 256):
    Q8_0  34 B / 32 values:  half d, int8 qs[32]                          y = d * q
    Q4_0  18 B / 32 values:  half d, u8 qs[16] (low nibbles = values 0..15, high = 16..31)
                                                                           y = d * (q - 8)
    Q4_1  20 B / 32 values:  half d, half m, u8 qs[16]                    y = d * q + m
    Q5_0  22 B / 32 values:  half d, u32 qh (bit j = 5th bit of value j), u8 qs[16]
                                                                           y = d * (q - 16)
    Q5_1  24 B / 32 values:  half d, half m, u32 qh, u8 qs[16]            y = d * q + m
    Q4_K 144 B / 256 values: half d, half dmin, u8 scales[12] (8 packed 6-bit scales and mins),
                             u8 qs[128]; 8 sub-blocks of 32              y = (d*sc) * q - (dmin*m)
    Q5_K 176 B / 256 values: as Q4_K plus u8 qh[32] (bit s of qh[l] = 5th bit of sub-block s, item l)
    Q6_K 210 B / 256 values: u8 ql[128], u8 qh[64], int8 scales[16], half d; 16 groups of 16
                                                                           y = (d*sc) * (q - 32)
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

# ggml type ids (enum ggml_type in ggml.h); stable across GGUF versions.
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q5_0 = 6
GGML_TYPE_Q5_1 = 7
GGML_TYPE_Q8_0 = 8
GGML_TYPE_Q4_K = 12
GGML_TYPE_Q5_K = 13
GGML_TYPE_Q6_K = 14
GGML_TYPE_BF16 = 30

_QK_K = 256
_K_SCALE_BYTES = 12


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a float32 column of shape (num_blocks, 1)."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2, k) values: [:, 0] the low nibbles, [:, 1] the high nibbles."""
    return np.stack((packed & np.uint8(0x0F), packed >> np.uint8(4)), axis=1)


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    quants = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return quants * scale


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    quants = _nibbles(blocks[:, 2:]).reshape(len(blocks), 32).astype(np.int8) - np.int8(8)
    return quants.astype(np.float32) * scale


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    minimum = _half(blocks, 2)
    quants = _nibbles(blocks[:, 4:]).reshape(len(blocks), 32).astype(np.float32)
    return quants * scale + minimum


def _fifth_bits(high_bits: np.ndarray) -> np.ndarray:
    """(n, 4) bytes holding one little-endian u32 -> (n, 32) values whose bit 4 is bit j of it."""
    bits = np.unpackbits(np.ascontiguousarray(high_bits), axis=1, bitorder="little")
    return bits << np.uint8(4)


def _dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    low = _nibbles(blocks[:, 6:]).reshape(len(blocks), 32)
    quants = (low | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return quants.astype(np.float32) * scale


def _dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    minimum = _half(blocks, 2)
    low = _nibbles(blocks[:, 8:]).reshape(len(blocks), 32)
    quants = (low | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return quants * scale + minimum


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte field of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins, each (n, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; the top 2 bits of bytes 0-3
    and 4-7 are the high bits of scales 4-7 and mins 4-7, whose low 4 bits sit in bytes 8-11
    (low nibble: scale, high nibble: min).
    """
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six_bits = np.uint8(0x3F)
    scales = np.concatenate(
        (first & six_bits, (third & np.uint8(0x0F)) | ((first >> np.uint8(6)) << np.uint8(4))), axis=1
    )
    mins = np.concatenate(
        (second & six_bits, (third >> np.uint8(4)) | ((second >> np.uint8(6)) << np.uint8(4))), axis=1
    )
    return scales, mins


def _k_affine(blocks: np.ndarray, quants: np.ndarray) -> np.ndarray:
    """y = (d * scale) * q - (dmin * min) for Q4_K/Q5_K; `quants` is (n, 8, 32) float32."""
    num_blocks = len(blocks)
    scale = _half(blocks, 0)
    min_scale = _half(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4 : 4 + _K_SCALE_BYTES])
    sub_scale = (scale * scales.astype(np.float32)).reshape(num_blocks, 8, 1)
    sub_min = (min_scale * mins.astype(np.float32)).reshape(num_blocks, 8, 1)
    return (sub_scale * quants - sub_min).reshape(num_blocks, _QK_K)


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    # qs is 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1.
    packed = blocks[:, 4 + _K_SCALE_BYTES :].reshape(len(blocks), 4, 32)
    quants = np.stack((packed & np.uint8(0x0F), packed >> np.uint8(4)), axis=2)
    return _k_affine(blocks, quants.reshape(len(blocks), 8, 32).astype(np.float32))


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    num_blocks = len(blocks)
    high_start = 4 + _K_SCALE_BYTES
    high = blocks[:, high_start : high_start + 32]
    packed = blocks[:, high_start + 32 :].reshape(num_blocks, 4, 32)
    low = np.stack((packed & np.uint8(0x0F), packed >> np.uint8(4)), axis=2).reshape(num_blocks, 8, 32)
    # Bit s of qh[l] is the 5th bit of item l of sub-block s.
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    fifth = ((high[:, None, :] >> shifts) & np.uint8(1)) << np.uint8(4)
    return _k_affine(blocks, (low | fifth).astype(np.float32))


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    num_blocks = len(blocks)
    # Two halves of 128 values; half h uses ql[64h:64h+64] and qh[32h:32h+32]. Within a half,
    # quarter k (32 values) takes low nibbles of ql[0:32] / ql[32:64] for k = 0 / 1 and high nibbles
    # for k = 2 / 3, and bits 2k..2k+1 of qh as its top two bits.
    low_packed = blocks[:, :128].reshape(num_blocks, 2, 2, 32)
    low = np.stack((low_packed & np.uint8(0x0F), low_packed >> np.uint8(4)), axis=2)  # (n, half, nib, 2, 32)
    low = low.reshape(num_blocks, 2, 4, 32)
    high_packed = blocks[:, 128:192].reshape(num_blocks, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high_packed >> shifts) & np.uint8(0x03)
    quants = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    group_scale = (_half(blocks, 208) * scales).reshape(num_blocks, 16, 1)
    return (group_scale * quants.reshape(num_blocks, 16, 16).astype(np.float32)).reshape(num_blocks, _QK_K)


_BlockDecoder = Callable[[np.ndarray], np.ndarray]

# ggml type id -> (name, values per block, bytes per block, decoder or None for plain floats)
_FORMATS: dict[int, tuple[str, int, int, _BlockDecoder | None]] = {
    GGML_TYPE_F32: ("F32", 1, 4, None),
    GGML_TYPE_F16: ("F16", 1, 2, None),
    GGML_TYPE_BF16: ("BF16", 1, 2, None),
    GGML_TYPE_Q8_0: ("Q8_0", 32, 34, _dequantize_q8_0),
    GGML_TYPE_Q4_0: ("Q4_0", 32, 18, _dequantize_q4_0),
    GGML_TYPE_Q4_1: ("Q4_1", 32, 20, _dequantize_q4_1),
    GGML_TYPE_Q5_0: ("Q5_0", 32, 22, _dequantize_q5_0),
    GGML_TYPE_Q5_1: ("Q5_1", 32, 24, _dequantize_q5_1),
    GGML_TYPE_Q4_K: ("Q4_K", _QK_K, 144, _dequantize_q4_k),
    GGML_TYPE_Q5_K: ("Q5_K", _QK_K, 176, _dequantize_q5_k),
    GGML_TYPE_Q6_K: ("Q6_K", _QK_K, 210, _dequantize_q6_k),
}

SUPPORTED_TYPE_NAMES: tuple[str, ...] = tuple(name for name, _, _, _ in _FORMATS.values())

# Decode this many blocks at a time: bounds the temporaries (a few x 4 bytes per value) for big
# embedding matrices without a per-block loop.
_BLOCKS_PER_CHUNK = 1 << 16


def is_supported_type(ggml_type: int) -> bool:
    return int(ggml_type) in _FORMATS


def ggml_type_name(ggml_type: int) -> str:
    """The ggml name of a type id ('Q4_K'), or 'type <id>' for ids this module does not know."""
    entry = _FORMATS.get(int(ggml_type))
    if entry is not None:
        return entry[0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"type {int(ggml_type)}"


def num_payload_bytes(ggml_type: int, num_values: int) -> int:
    """Bytes a tensor of `num_values` values of `ggml_type` occupies in the file."""
    _, block_size, type_size, _ = _FORMATS[int(ggml_type)]
    return num_values // block_size * type_size


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], tensor_name: str = "<tensor>") -> np.ndarray:
    """Decode a tensor's raw payload into a float32 array of its logical `shape` (row-major, HF order).

    `raw` is the tensor's bytes (any dtype; only its memory is read). Raises ValueError naming the
    tensor when the type is unsupported, the row length is not a whole number of blocks, or the
    payload size does not match the shape.
    """
    type_id = int(ggml_type)
    if type_id not in _FORMATS:
        raise ValueError(
            f"GGUF tensor {tensor_name!r} has quantization type {ggml_type_name(type_id)} "
            f"(ggml type id {type_id}), which pagedserve cannot dequantize; supported types: "
            f"{', '.join(SUPPORTED_TYPE_NAMES)}"
        )
    name, block_size, type_size, decoder = _FORMATS[type_id]
    num_values = int(np.prod(shape, dtype=np.int64)) if shape else 1
    row_length = shape[-1] if shape else 1
    if row_length % block_size != 0:
        raise ValueError(
            f"GGUF tensor {tensor_name!r} of type {name} has rows of {row_length} values, "
            f"which is not a multiple of the block size {block_size}"
        )
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected_bytes = num_values // block_size * type_size
    if data.size != expected_bytes:
        raise ValueError(
            f"GGUF tensor {tensor_name!r} of type {name} and shape {tuple(shape)} should hold "
            f"{expected_bytes} bytes, but its payload has {data.size}"
        )
    if type_id == GGML_TYPE_F32:
        values = data.view(np.float32).copy()
    elif type_id == GGML_TYPE_F16:
        values = data.view(np.float16).astype(np.float32)
    elif type_id == GGML_TYPE_BF16:
        # bfloat16 is the top half of a float32.
        values = (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        assert decoder is not None
        blocks = data.reshape(-1, type_size)
        values = np.empty((len(blocks), block_size), dtype=np.float32)
        for start in range(0, len(blocks), _BLOCKS_PER_CHUNK):
            stop = start + _BLOCKS_PER_CHUNK
            values[start:stop] = decoder(blocks[start:stop])
    return values.reshape(shape)
