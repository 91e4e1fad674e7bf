"""Load a GGUF file as an HF-shaped model: a transformers config, HF-named weights and a tokenizer.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", torch.bfloat16)
    model.hf_config        # LlamaConfig / Qwen2Config / Qwen3Config (with the cache, maybe a snapshot of one)
    model.weights()        # iterator of (HF parameter name, tensor) in the model dtype
    model.tokenizer        # transformers PreTrainedTokenizerFast

The weights stream plugs into the model loader like safetensors does. llama.cpp stores tensors
under its own names (blk.N.attn_q.weight, ...) and, for the `llama` architecture, with the rows of
Q and K permuted per head into its rotary layout; both are undone here so the tensors equal what
`transformers` loads from the same file.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from collections.abc import Iterator
from typing import NamedTuple
from typing import Any

import numpy as np
import torch

from pagedserve.model_loader import gguf_dequant, hf_config_snapshot
from pagedserve.model_loader.gguf_cache import MetadataCache, WeightCache, cache_root, source_fingerprint

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# general.architecture -> HF architecture class name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<part>.<weight|bias> -> model.layers.N.<module>.<weight|bias>
_LAYER_MODULE_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class TensorInfo(NamedTuple):
    """One entry of a GGUF tensor table: llama.cpp name, ggml type id, logical (HF-order) shape, and the byte
    offset of its payload in the file (what lets a warm start read the weights without parsing the header)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data_offset: int


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name, or None when it has no HF counterpart."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_MODULE_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_MODULE_NAMES[part]}.{kind}"


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a llama Q or K projection (weight or bias).

    HF's rotary embedding pairs row i with row i + head_dim/2 of each head ("rotate half");
    llama.cpp's converter interleaves those pairs to rows 2i, 2i+1. Rows are grouped as
    (head, pair index, half) in the file and as (head, half, pair index) in HF.
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads) != 0:
        raise ValueError(
            f"cannot un-permute a rotary projection with {num_rows} rows over {num_heads} heads "
            f"(rows must be a multiple of 2 * heads)"
        )
    half_head_dim = num_rows // num_heads // 2
    grouped = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _check_magic(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path!r} is not a GGUF file: bad magic {magic!r} (expected {GGUF_MAGIC!r}; "
            f"file size {os.path.getsize(path)} bytes)"
        )


def _plain_array_reader_class() -> type:
    from gguf import GGUFReader

    class PlainArrayGGUFReader(GGUFReader):
        """GGUFReader parsing through a plain ndarray view of its file map instead of the np.memmap.

        numpy's memmap subclass runs Python hooks on every slice, and the reader slices once or twice per
        vocabulary string and merge (~250k slices for SmolLM2's 49k-token vocabulary): ~3 s of a cold
        load. The view keeps the map alive and reads the same bytes.
        """

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if type(self.data) is not np.ndarray:
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    return PlainArrayGGUFReader


def _open_reader(path: str) -> Any:
    """A GGUFReader over `path`, with every tensor payload checked to lie inside the file."""
    _check_magic(path)
    file_size = os.path.getsize(path)
    try:
        reader = _plain_array_reader_class()(path)
    except Exception as error:  # the reader raises IndexError/ValueError/struct errors on short reads
        raise ValueError(
            f"GGUF file {path!r} is truncated or corrupt ({file_size} bytes): {type(error).__name__}: {error}"
        ) from error
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size:
            raise ValueError(
                f"GGUF file {path!r} is truncated: tensor {tensor.name!r} ends at byte {end} "
                f"but the file has {file_size} bytes"
            )
    return reader


def _parse(path: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The metadata (all keys but the GGUF.* header, as Python values) and tensor table."""
    reader = _open_reader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    # GGUF lists dimensions innermost first; HF/numpy shapes are the reverse.
    tensors = [
        TensorInfo(tensor.name, int(tensor.tensor_type), tuple(int(d) for d in reversed(tensor.shape.tolist())),
                   int(tensor.data_offset))
        for tensor in reader.tensors
    ]
    return metadata, tensors


def _require_int(metadata: dict[str, Any], key: str, path: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"GGUF file {path!r} lacks the metadata key {key!r}, which the model config needs")
    if isinstance(value, list):
        raise ValueError(
            f"GGUF file {path!r}: {key}={value!r} varies per layer, which pagedserve does not support"
        )
    return int(value)


def _rope_parameters(metadata: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default"}
    theta = metadata.get(f"{arch}.rope.freq_base")
    if theta is not None:
        rope["rope_theta"] = float(theta)
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return rope
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
        return rope
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if scaling == "yarn" and factor is not None and original is not None:
        rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original))
        return rope
    raise ValueError(
        f"GGUF file {path!r}: {arch}.rope.scaling.type={scaling!r} (factor={factor!r}) is not supported; "
        f"supported: none, linear (with factor), yarn (with factor and original_context_length)"
    )


def hf_config_fields(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                     path: str) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, constructor fields) of the config described by the GGUF metadata (and
    the tensor table, for biases, tied embeddings and a vocab size the metadata omits)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r}: general.architecture={arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    hidden_size = _require_int(metadata, f"{arch}.embedding_length", path)
    num_heads = _require_int(metadata, f"{arch}.attention.head_count", path)
    num_kv_heads = _require_int(metadata, f"{arch}.attention.head_count_kv", path, default=num_heads)
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    if head_dim is None:
        head_dim = hidden_size // num_heads
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None and "token_embd.weight" in tensor_shapes:
        vocab_size = tensor_shapes["token_embd.weight"][0]
    if vocab_size is None:
        vocab_size = len(metadata.get("tokenizer.ggml.tokens") or [])
    if not vocab_size:
        raise ValueError(f"GGUF file {path!r}: no {arch}.vocab_size, token_embd.weight or tokenizer.ggml.tokens")

    fields: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "hidden_size": hidden_size,
        "num_hidden_layers": _require_int(metadata, f"{arch}.block_count", path),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(head_dim),
        "intermediate_size": _require_int(metadata, f"{arch}.feed_forward_length", path),
        "vocab_size": int(vocab_size),
        "rope_parameters": _rope_parameters(metadata, arch, path),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    context_length = metadata.get(f"{arch}.context_length")
    if context_length is not None:
        fields["max_position_embeddings"] = int(context_length)
    rms_eps = metadata.get(f"{arch}.attention.layer_norm_rms_epsilon")
    if rms_eps is not None:
        fields["rms_norm_eps"] = float(rms_eps)
    has_attention_bias = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "llama":
        fields["attention_bias"] = has_attention_bias
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
        return "LlamaConfig", fields
    if arch == "qwen2":
        # Qwen2 always has Q/K/V biases; there is no flag for it in Qwen2Config.
        return "Qwen2Config", fields
    fields["attention_bias"] = has_attention_bias
    return "Qwen3Config", fields


def build_hf_config(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], path: str) -> Any:
    """The transformers config described by the GGUF metadata (LlamaConfig / Qwen2Config / Qwen3Config)."""
    return hf_config_snapshot.build_config(*hf_config_fields(metadata, tensor_shapes, path))


class GGUFModel:
    """A GGUF file opened as an HF-shaped model. Build with `load_gguf`."""

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        use_cache: bool,
        metadata: dict[str, Any],
        tensors: list[TensorInfo],
    ) -> None:
        self.path = path
        self.dtype = dtype
        self.use_cache = use_cache
        self.metadata = metadata
        self.tensors = tensors
        self.architecture = str(metadata.get("general.architecture"))
        shapes = {tensor.name: tensor.shape for tensor in tensors}
        # With the cache, a recorded snapshot of the config when there is one (importing the transformers config
        # class costs seconds; model_loader/hf_config_snapshot.py); it reads exactly like the real config.
        self.hf_config = hf_config_snapshot.load_config(*hf_config_fields(metadata, shapes, path)) if use_cache \
            else build_hf_config(metadata, shapes, path)
        self._check_tensors()

    def _check_tensors(self) -> None:
        """Fail at load time, not mid-stream, on tensors we cannot turn into HF weights."""
        for tensor in self.tensors:
            if tensor.name == "rope_freqs.weight":
                raise ValueError(
                    f"GGUF file {self.path!r}: tensor 'rope_freqs.weight' (llama3-style rope frequency "
                    f"factors) is not supported"
                )
            if hf_tensor_name(tensor.name) is None:
                logger.warning("GGUF file %s: ignoring tensor %r (no HF counterpart)", self.path, tensor.name)
                continue
            if not gguf_dequant.is_supported_type(tensor.ggml_type):
                raise ValueError(
                    f"GGUF file {self.path!r}: tensor {tensor.name!r} has quantization type "
                    f"{gguf_dequant.ggml_type_name(tensor.ggml_type)}, which pagedserve cannot dequantize; "
                    f"supported types: {', '.join(gguf_dequant.SUPPORTED_TYPE_NAMES)}"
                )

    def weight_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every weight `weights()` yields, in yield order."""
        return [(name, tensor.shape) for tensor in self.tensors if (name := hf_tensor_name(tensor.name)) is not None]

    def _named_payloads(self) -> Iterator[tuple[str, TensorInfo, np.ndarray]]:
        """(HF name, table entry, its payload bytes) of every weight, read through a map of the file at the
        table's offsets (no header parsing: the table may come from the metadata cache, whose entry is keyed by
        the file's fingerprint). The map goes when the stream ends: its pages are not the weights' memory."""
        file_map = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)  # plain slices: no memmap hooks
        for tensor in self.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                continue
            num_bytes = gguf_dequant.num_payload_bytes(tensor.ggml_type, int(np.prod(tensor.shape, dtype=np.int64)))
            end = tensor.data_offset + num_bytes
            if tensor.data_offset < 0 or end > file_map.size:
                raise ValueError(f"GGUF file {self.path!r} is truncated: tensor {tensor.name!r} ends at byte {end} "
                                 f"but the file has {file_map.size} bytes")
            yield name, tensor, file_map[tensor.data_offset:end]

    def _dequantized_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor, payload in self._named_payloads():
            yield name, self._dequantized_tensor(tensor, payload, dtype)

    def _in_hf_row_order(self, tensor: TensorInfo, rows: np.ndarray) -> np.ndarray:
        """`rows` (values, or a quantized tensor's block rows) with llama.cpp's Q/K rotary row order undone."""
        if self.architecture == "llama":
            if ".attn_q." in tensor.name:
                return unpermute_rotary_rows(rows, int(self.hf_config.num_attention_heads))
            if ".attn_k." in tensor.name:
                return unpermute_rotary_rows(rows, int(self.hf_config.num_key_value_heads))
        return rows

    def _dequantized_tensor(self, tensor: TensorInfo, payload: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        values = gguf_dequant.dequantize(payload, tensor.ggml_type, tensor.shape, tensor.name)
        weight = torch.from_numpy(np.ascontiguousarray(self._in_hf_row_order(tensor, values)))
        return weight if dtype == torch.float32 else weight.to(dtype)

    def _block_rows(self, tensor: TensorInfo, payload: np.ndarray) -> torch.Tensor:
        """A quantized tensor's blocks as uint8 [rows, bytes per row], rows in HF order."""
        rows = int(np.prod(tensor.shape[:-1], dtype=np.int64))
        blocks = self._in_hf_row_order(tensor, payload.reshape(rows, -1))
        return torch.from_numpy(np.array(blocks))  # a writable copy: the file map is read-only

    def quantized_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight stream for `model` with every module that can keep its blocks turned into a quantized module
        first (model_loader/gguf_quantized_load.py): those tensors come as uint8 block rows, the others as
        `weights(dtype)` gives them."""
        from pagedserve.model_loader.gguf_quantized_load import convert_kept_modules, describe_kept, \
            plan_kept_quantized

        types = {name: tensor.ggml_type for tensor in self.tensors if (name := hf_tensor_name(tensor.name))}
        kept = plan_kept_quantized(model, types)
        if not kept:
            logger.info("GGUF file %s: no module can keep its quantized blocks here; weights dequantized", self.path)
            return self.weights(dtype)
        convert_kept_modules(model, kept)
        logger.info("%s", describe_kept(kept, len(types)))
        return self._kept_quantized_weights(dtype, {name for entry in kept for name in entry.checkpoint_names})

    def _kept_quantized_weights(self, dtype: torch.dtype, kept: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor, payload in self._named_payloads():
            if name in kept:
                yield name, self._block_rows(tensor, payload)
            else:
                yield name, self._dequantized_tensor(tensor, payload, dtype)

    def weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) for every weight, in `dtype` (default: the load dtype).

        With `use_cache`, a valid cache entry is read back; otherwise the tensors are dequantized
        and written through to a new cache entry as they are yielded.
        """
        dtype = self.dtype if dtype is None else dtype
        if not self.use_cache:
            return self._dequantized_weights(dtype)
        cache = WeightCache(self.path, dtype, self.weight_layout())
        if cache.is_valid():
            return cache.read()
        return cache.write_through(self._dequantized_weights(dtype))

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The transformers fast tokenizer described by the file's tokenizer.ggml.* metadata (with the cache,
        its `tokenizers` pipeline is kept under tokenizers/ in the cache folder, named after the file's
        fingerprint, the building code and the tokenizers version)."""
        from pagedserve.model_loader import gguf_tokenizer

        cache_path = None
        if self.use_cache:
            import tokenizers

            with open(gguf_tokenizer.__file__, "rb") as f:
                builder = hashlib.sha256(f.read() + tokenizers.__version__.encode()).hexdigest()[:16]
            stem = os.path.splitext(os.path.basename(self.path))[0]
            cache_path = os.path.join(cache_root(), "tokenizers",
                                      f"{stem}-{source_fingerprint(self.path)[:24]}-{builder}.json")
        return gguf_tokenizer.build_tokenizer(self.metadata, source=self.path, cache_path=cache_path)


def load_gguf(path: str, dtype: torch.dtype | None = None, use_cache: bool = True) -> GGUFModel:
    """Open a GGUF file: parse and validate its metadata and tensor table (weights load lazily).

    `dtype` is the dtype `weights()` yields by default (float32 when None). With `use_cache`, the
    parsed metadata and the dequantized weights are cached under the user cache folder (see
    gguf_cache), so a second load skips parsing and dequantization. Raises ValueError naming the
    file and the offending key or tensor for a missing, truncated or corrupt file, an unsupported
    architecture or an unsupported quantization type.
    """
    if dtype is None:
        dtype = torch.float32
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not valid for GGUF weights; expected float32, bfloat16 or float16")
    _check_magic(path)
    if not use_cache:
        metadata, tensors = _parse(path)
        return GGUFModel(path, dtype, use_cache, metadata, tensors)
    metadata_cache = MetadataCache(path)
    cached = metadata_cache.read()
    if cached is not None:
        metadata, tensor_rows = cached
        tensors = [TensorInfo(str(name), int(ggml_type), tuple(shape), int(offset))
                   for name, ggml_type, shape, offset in tensor_rows]
    else:
        metadata, tensors = _parse(path)
    model = GGUFModel(path, dtype, use_cache, metadata, tensors)
    if cached is None:
        # Only a file that parsed and validated gets its metadata cached.
        metadata_cache.write(metadata, [list(tensor) for tensor in tensors])
    return model
