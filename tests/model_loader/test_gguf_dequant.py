"""Our GGUF dequantizers are bit-exact with gguf-py's reference (`gguf.quants.dequantize`)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from pagedserve.model_loader.default_model import resolve_model_path
from pagedserve.model_loader.gguf_dequant import SUPPORTED_TYPE_NAMES, dequantize

# Types gguf-py can quantize: the test data is real quantized tensors.
QUANTIZABLE_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Types gguf-py only dequantizes: the test data is random payload bytes with sane fp16 scales.
RAW_BLOCK_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the float16 scale fields of each raw-block type.
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _assert_bit_exact(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == reference.shape
    # Compare the bit patterns: catches -0.0 vs 0.0 and any 1-ulp difference.
    mismatches = np.count_nonzero(ours.view(np.uint32) != reference.astype(np.float32).view(np.uint32))
    assert mismatches == 0, f"{mismatches} of {ours.size} values differ"


def test_supported_list_is_the_promised_one() -> None:
    assert set(SUPPORTED_TYPE_NAMES) == set(QUANTIZABLE_TYPES + RAW_BLOCK_TYPES)


@pytest.mark.parametrize("type_name", QUANTIZABLE_TYPES)
@pytest.mark.parametrize("shape", [(5, 256), (3, 2, 64), (96,)])
def test_quantized_tensors_bit_exact(type_name: str, shape: tuple[int, ...]) -> None:
    ggml_type = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(sum(shape) + ggml_type.value)
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    values.reshape(-1)[:7] = [0.0, -0.0, 1e-8, -3.5, 65504.0, 1e-5, -2.0]  # edge values
    raw = quants.quantize(values, ggml_type)
    _assert_bit_exact(dequantize(raw, ggml_type.value, shape), quants.dequantize(raw, ggml_type))


@pytest.mark.parametrize("type_name", RAW_BLOCK_TYPES)
def test_random_k_blocks_bit_exact(type_name: str) -> None:
    ggml_type = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(ggml_type.value)
    shape = (6, 4 * block_size)
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in SCALE_OFFSETS[type_name]:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    _assert_bit_exact(dequantize(raw, ggml_type.value, shape), quants.dequantize(raw, ggml_type))


def test_unsupported_type_names_tensor_type_and_supported_list() -> None:
    raw = np.zeros((2, 84), dtype=np.uint8)  # two Q2_K blocks
    with pytest.raises(ValueError) as error:
        dequantize(raw, GGMLQuantizationType.Q2_K.value, (2, 256), "blk.0.attn_q.weight")
    message = str(error.value)
    assert "blk.0.attn_q.weight" in message and "Q2_K" in message
    assert all(name in message for name in SUPPORTED_TYPE_NAMES)


def test_payload_size_mismatch_is_a_value_error() -> None:
    raw = np.zeros(33, dtype=np.uint8)
    with pytest.raises(ValueError, match="token_embd.weight.*34 bytes"):
        dequantize(raw, GGMLQuantizationType.Q8_0.value, (1, 32), "token_embd.weight")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), GGMLQuantizationType.Q8_0.value, (2, 16), "x")


def test_every_tensor_of_the_smollm2_file_bit_exact() -> None:
    reader = GGUFReader(resolve_model_path(None))
    seen_types = set()
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        ours = dequantize(tensor.data, int(tensor.tensor_type), shape, tensor.name)
        _assert_bit_exact(ours, quants.dequantize(tensor.data, tensor.tensor_type))
        seen_types.add(tensor.tensor_type.name)
    assert seen_types == {"F32", "Q4_1", "Q8_0"}
    assert len(reader.tensors) == 272
