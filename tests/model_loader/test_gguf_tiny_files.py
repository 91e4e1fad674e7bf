"""Tiny GGUF files written offline with gguf's writer, shared by the GGUF loader and cache tests.

`write_tiny_gguf` builds a 2-layer model of a given architecture with a small byte-level BPE
vocabulary; the tests here check the builder itself round-trips through gguf's reader.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from transformers.convert_slow_tokenizer import bytes_to_unicode

from k_quant_blocks import quantize_k

HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 96
NUM_LAYERS = 2
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
K_QUANT_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte tokens, then one per merge."""
    byte_tokens = list(bytes_to_unicode().values())
    merged = ["".join(merge.split(" ")) for merge in MERGES]
    tokens = CONTROL_TOKENS + byte_tokens + merged
    token_types = [3] * len(CONTROL_TOKENS) + [1] * (len(byte_tokens) + len(merged))
    return tokens, token_types, MERGES


def write_tiny_gguf(
    path: str,
    architecture: str = "llama",
    weight_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    with_output: bool = False,
    add_bos: bool = False,
    seed: int = 0,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
    norm_weights_near_one: bool = False,
    hidden_size: int = HIDDEN_SIZE,
    intermediate_size: int = INTERMEDIATE_SIZE,
) -> dict[str, np.ndarray]:
    """Write a tiny model to `path`; returns the float32 values each tensor was quantized from. `tensor_types`
    overrides the type of single tensors (by GGUF name), as mixed files such as Q4_K_M do. `norm_weights_near_one`
    draws the RMSNorm weights around 1 (as trained models have them) instead of around 0, so that the logits spread
    and greedy picks have margins. `hidden_size` and `intermediate_size` (multiples of 256 for K-quant matrices, whose
    blocks k_quant_blocks.quantize_k makes) keep NUM_HEADS heads of hidden_size / NUM_HEADS values."""
    head_dim = hidden_size // NUM_HEADS
    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocabulary()
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if architecture.startswith("qwen") else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    values: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> None:
        ggml_type = (tensor_types or {}).get(name, ggml_type)
        array = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if norm_weights_near_one and name.endswith("norm.weight"):
            array += 1
        values[name] = array
        if ggml_type == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif ggml_type in K_QUANT_TYPES:
            writer.add_tensor(name, quantize_k(array, ggml_type), raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, quants.quantize(array, ggml_type), raw_dtype=ggml_type)

    q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    add("token_embd.weight", (len(tokens), hidden_size), weight_type)
    for layer in range(NUM_LAYERS):
        prefix = f"blk.{layer}"
        add(f"{prefix}.attn_norm.weight", (hidden_size,), GGMLQuantizationType.F32)
        add(f"{prefix}.attn_q.weight", (q_rows, hidden_size), weight_type)
        add(f"{prefix}.attn_k.weight", (kv_rows, hidden_size), weight_type)
        add(f"{prefix}.attn_v.weight", (kv_rows, hidden_size), weight_type)
        add(f"{prefix}.attn_output.weight", (hidden_size, q_rows), weight_type)
        if architecture == "qwen2":
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                add(f"{prefix}.{part}.bias", (rows,), GGMLQuantizationType.F32)
        if architecture == "qwen3":
            add(f"{prefix}.attn_q_norm.weight", (head_dim,), GGMLQuantizationType.F32)
            add(f"{prefix}.attn_k_norm.weight", (head_dim,), GGMLQuantizationType.F32)
        add(f"{prefix}.ffn_norm.weight", (hidden_size,), GGMLQuantizationType.F32)
        add(f"{prefix}.ffn_gate.weight", (intermediate_size, hidden_size), weight_type)
        add(f"{prefix}.ffn_up.weight", (intermediate_size, hidden_size), weight_type)
        add(f"{prefix}.ffn_down.weight", (hidden_size, intermediate_size), weight_type)
    add("output_norm.weight", (hidden_size,), GGMLQuantizationType.F32)
    if with_output:
        add("output.weight", (len(tokens), hidden_size), weight_type)
    for name, (raw, ggml_type) in (extra_tensors or {}).items():
        writer.add_tensor(name, raw, raw_dtype=ggml_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_tiny_file_round_trips_through_gguf_reader(tmp_path) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    values = write_tiny_gguf(path, "qwen3", GGMLQuantizationType.Q4_0, with_output=True)
    reader = GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    names = [tensor.name for tensor in reader.tensors]
    assert names == list(values)
    embedding = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    assert tuple(reversed(embedding.shape.tolist())) == values["token_embd.weight"].shape
    assert embedding.tensor_type == GGMLQuantizationType.Q4_0
