"""The 'cpu_native' attention backend: decodes and the K/V write through native kernels, the rest as torch_paged.

Decodes (the `num_decodes` single-token requests placed first) go to `pagedserve::paged_decode_attention`
(kernels/cpu/paged_attention.cpp), which reads K/V in place through the block table: one pass over
the KV bytes instead of torch_paged's gather + SDPA (three passes). The step's K/V write goes to
`pagedserve::reshape_and_cache`: one call for K and V that reads the (strided, fused-QKV) rows in place and
converts the dtype on the way, instead of two `.to()` copies and two index_copy_ calls; its result is
bitwise torch_paged.write_to_kv_cache's. On a CPU with AMX or AVX512-BF16, the prefill chunks and multi-token
steps (bfloat16 or float32) go to `pagedserve::paged_prefill_attention` (kernels/cpu/prefill_attention.cpp):
one call for all of a step's prefills, flash attention reading K/V in place, its products on AMX tiles or
VDPBF16PS dot products in bfloat16 and FMA in float32 (ATen's CPU flash attention ran at ~0.15 TFLOPS on
SmolLM2's bf16 prompts with AMX, ~0.05 without, and ~0.05 in float32). Everything else (head dims that are not
multiples of 64, padding rows, validation) is TorchPagedAttentionBackend's code, unchanged, so torch_paged stays
the oracle.

An int8 cache (kv_cache_dtype="int8", attention/kv_quantization.py) takes `pagedserve::reshape_and_cache_int8`
(quantizing on the way in), `pagedserve::paged_decode_attention_int8` (the decode kernel reading int8 rows and
their scales in place) and, where the prefill kernel runs, `pagedserve::paged_prefill_attention_int8`: the same
prefill kernel, whose pack phase reads the int8 rows and scales in place through the block table and dequantizes
them into its working tiles (bitwise the prefill kernel over the cache dequantized to the query's dtype). Where it
does not run, int8 prefills take torch_paged's path (gather the blocks, dequantize, SDPA): the reference.

The kernels are torch.library ops with fake (meta) implementations, so torch.compile treats them as
opaque nodes. Each decode's result depends only on that request (fixed context partitions, fixed
summation order): batch invariant, and independent of the thread count.
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.kv_quantization import is_int8_kv_cache, kv_cache_scales
from pagedserve.kernels.cpu_library import is_native_extension_available, load_native_extension
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend, validate_inputs

# Context tokens per work item of the kernel (flash-decoding partitions, merged in order). Part of the
# numerics: changing it changes results in the last bits, never with the batch. 128 keeps items of similar
# cost while the merge stays negligible, and gives a short context enough items to balance: a batch-1 step of
# SmolLM2 (3 KV heads) at a 128-384 token context split 3 items 2:1 over 2 threads at 256 (decode ~3% slower
# than at 128 in one process; 64 measured the same as 128).
DECODE_PARTITION_TOKENS = 128

_fake_registered = False


def _register_fake() -> None:
    """The op's shape function for torch.compile / meta tensors (registered once, after the library loads)."""
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake("pagedserve::paged_decode_attention")
    def _paged_decode_attention_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                                     partition_size: int) -> torch.Tensor:
        return query.new_empty(query.shape)

    @torch.library.register_fake("pagedserve::paged_prefill_attention")
    def _paged_prefill_attention_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                                      sliding_window: int | None, products: str = "auto") -> torch.Tensor:
        return query.new_empty(query.shape)

    @torch.library.register_fake("pagedserve::paged_prefill_attention_int8")
    def _paged_prefill_attention_int8_fake(query: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor,
                                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                                           query_start_loc: torch.Tensor, scale: float, sliding_window: int | None,
                                           products: str = "auto") -> torch.Tensor:
        return query.new_empty(query.shape)

    @torch.library.register_fake("pagedserve::reshape_and_cache")
    def _reshape_and_cache_fake(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
        return None  # mutates kv_cache in place; no output

    @torch.library.register_fake("pagedserve::paged_decode_attention_int8")
    def _paged_decode_attention_int8_fake(query: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor,
                                          block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                          sliding_window: int | None, partition_size: int) -> torch.Tensor:
        return query.new_empty(query.shape)

    @torch.library.register_fake("pagedserve::reshape_and_cache_int8")
    def _reshape_and_cache_int8_fake(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                     kv_scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        return None

    _fake_registered = True


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           partition_size: int = DECODE_PARTITION_TOKENS) -> torch.Tensor:
    """Attention of one query token per request over its paged context.

    query [num_decodes, num_heads, head_dim] (head_dim contiguous; row/head strides may be any),
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous, float32 or bfloat16),
    block_table [num_decodes, max_blocks] int32, seq_lens [num_decodes] int32 (the query sits at
    seq_len - 1). Returns [num_decodes, num_heads, head_dim] in the query's dtype.
    Builds/loads the kernels at first use (RuntimeError when they are unavailable).
    An int8 cache (the data view of kv_quantization's pages) is read with its scale view, in place.
    """
    if not _fake_registered:
        load_native_extension()
        _register_fake()
    if is_int8_kv_cache(kv_cache):
        return torch.ops.pagedserve.paged_decode_attention_int8(query, kv_cache, kv_cache_scales(kv_cache),
                                                                block_table, seq_lens, scale, sliding_window,
                                                                partition_size)
    return torch.ops.pagedserve.paged_decode_attention(query, kv_cache, block_table, seq_lens, scale,
                                                       sliding_window, partition_size)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            sliding_window: int | None = None, products: str = "auto") -> torch.Tensor:
    """Causal attention of several requests' new tokens over their paged contexts (bfloat16 or float32).

    query [num_tokens, num_heads, head_dim] bfloat16 or float32 (heads contiguous, any row stride; head_dim a
    multiple of 64 up to 256), kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] of the same dtype
    (contiguous, already holding the new tokens' K/V) or an int8 cache (the data view of kv_quantization's pages,
    read in place with its scale view and dequantized to the query's dtype), block_table [R, max_blocks], seq_lens [R] and
    query_start_loc [R + 1] int32 (request r owns query rows query_start_loc[r]:query_start_loc[r + 1], its last
    tokens). Returns [num_tokens, num_heads, head_dim] in the query's dtype. `products`: the unit for both
    products, 'amx' or 'avx512_bf16' (bfloat16), 'avx512_fp32' (float32) or 'auto' (float32: 'avx512_fp32';
    bfloat16: AMX where usable, else AVX512-BF16); prefill_attention_products() lists the available ones.
    RuntimeError where the kernels or the unit are unavailable.
    """
    if not _fake_registered:
        load_native_extension()
        _register_fake()
    if is_int8_kv_cache(kv_cache):
        return torch.ops.pagedserve.paged_prefill_attention_int8(query, kv_cache, kv_cache_scales(kv_cache),
                                                                 block_table, seq_lens, query_start_loc, scale,
                                                                 sliding_window, products)
    return torch.ops.pagedserve.paged_prefill_attention(query, kv_cache, block_table, seq_lens, query_start_loc,
                                                        scale, sliding_window, products)


def is_prefill_attention_available() -> bool:
    """True when the native library is loaded and this build and process can run the prefill kernel (AMX or
    AVX512-BF16)."""
    return is_native_extension_available() and bool(torch.ops.pagedserve.is_prefill_attention_supported())


def prefill_attention_products() -> list[str]:
    """The prefill kernel's product units usable here: the bfloat16 ones preferred first ('amx', 'avx512_bf16'),
    then 'avx512_fp32' (float32); [] without the native library."""
    if not is_native_extension_available():
        return []
    return list(torch.ops.pagedserve.prefill_attention_products())


def prefill_kernel_dtypes() -> frozenset[torch.dtype]:
    """The query/cache dtypes the prefill kernel has a unit for here."""
    units = prefill_attention_products()
    dtypes = {torch.bfloat16} if {"amx", "avx512_bf16"} & set(units) else set()
    if "avx512_fp32" in units:
        dtypes.add(torch.float32)
    return frozenset(dtypes)


def can_use_prefill_kernel(query: torch.Tensor, kv_cache: torch.Tensor, dtypes: frozenset[torch.dtype]) -> bool:
    """Whether paged_prefill_attention takes these tensors (a query of a dtype in `dtypes`, from
    prefill_kernel_dtypes(), and a cache of its dtype or int8; head_dim a multiple of 64 up to 256, heads
    contiguous)."""
    head_dim = query.shape[-1]
    return (query.dtype in dtypes and kv_cache.dtype in (query.dtype, torch.int8) and head_dim % 64 == 0
            and head_dim <= 256 and query.stride(-1) == 1 and query.stride(-2) == head_dim)


# The dtypes the native K/V write converts between (anything else takes write_to_kv_cache).
_NATIVE_WRITE_DTYPES = (torch.float32, torch.bfloat16)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Writes K/V rows into the paged cache in place: the native form of torch_paged.write_to_kv_cache.

    key, value [num_tokens, num_kv_heads, head_dim] (float32 or bfloat16, one dtype; any strides, a contiguous
    head_dim is the fast path); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous,
    float32 or bfloat16); slot_mapping [num_tokens] int64 flat slots (block_id * block_size + offset), a
    negative slot is skipped.
    Bitwise equal to write_to_kv_cache (float32 -> bfloat16 rounds to nearest even, as Tensor.to does).
    Raises RuntimeError on a slot past the cache, before writing anything.
    """
    if not _fake_registered:
        load_native_extension()
        _register_fake()
    if is_int8_kv_cache(kv_cache):  # quantizes: bitwise kv_quantization.write_to_int8_kv_cache
        torch.ops.pagedserve.reshape_and_cache_int8(key, value, kv_cache, kv_cache_scales(kv_cache), slot_mapping)
        return
    torch.ops.pagedserve.reshape_and_cache(key, value, kv_cache, slot_mapping)


class CpuNativeAttentionBackend(TorchPagedAttentionBackend):
    """torch_paged with the K/V write, the decodes and (AMX or AVX512-BF16) the prefills done by the native
    kernels (CPU tensors only; model-dtype or int8 caches)."""

    name = "cpu_native"

    def __init__(self) -> None:
        load_native_extension()  # RuntimeError naming the cause when the kernels cannot be built
        _register_fake()
        self.prefill_dtypes = prefill_kernel_dtypes()  # empty where the build or CPU has no unit

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        if not (0 < num_tokens == metadata.num_actual_tokens == metadata.num_decodes == metadata.num_seqs
                and query.device.type == "cpu"):
            return super().forward(query, key, value, kv_cache, metadata, scale, sliding_window)
        # A decode-only step without padding rows (every step of steady decoding): the K/V write and one kernel
        # call whose result is the output, without an output buffer, copies or loops. The inputs are validated
        # once per step and shape (every layer of a model shares them).
        validated = ("cpu_native_validated", query.shape, key.shape, kv_cache.shape, sliding_window)
        if validated not in metadata.backend_cache:
            validate_inputs(query, key, kv_cache, metadata, sliding_window)
            metadata.backend_cache[validated] = True
        self._write_kv(key, value, kv_cache, metadata.slot_mapping[:num_tokens])
        block_table, seq_lens = decode_inputs(metadata)
        return paged_decode_attention(query, kv_cache, block_table, seq_lens, scale, sliding_window)

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        # Only the dtypes are checked here (60 calls a step: each Python check costs ~0.3 us against the op's
        # ~3 us); the kernel takes any strides and rejects, with a message, what the runner never passes
        # (a non-contiguous cache, non-int64 slots, K and V of different dtypes).
        if key.dtype in _NATIVE_WRITE_DTYPES and kv_cache.dtype in _NATIVE_WRITE_DTYPES:
            torch.ops.pagedserve.reshape_and_cache(key, value, kv_cache, slot_mapping)
        elif key.dtype in _NATIVE_WRITE_DTYPES and kv_cache.dtype == torch.int8:
            torch.ops.pagedserve.reshape_and_cache_int8(key, value, kv_cache, kv_cache_scales(kv_cache), slot_mapping)
        else:
            super()._write_kv(key, value, kv_cache, slot_mapping)

    def _forward_prefills(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        output: torch.Tensor,
    ) -> None:
        if not can_use_prefill_kernel(query, kv_cache, self.prefill_dtypes):
            super()._forward_prefills(query, key, value, kv_cache, metadata, scale, sliding_window, output)
            return
        num_decodes, num_seqs = metadata.num_decodes, metadata.num_seqs
        starts = metadata.query_start_loc_cpu
        first_row, end_row = starts[num_decodes], starts[num_seqs]
        # int32 inputs the kernel reads directly; built once per step and shared by every layer.
        inputs = metadata.backend_cache.get("cpu_native_prefill_inputs")
        if inputs is None:
            block_table = _int32_rows(metadata.block_table, num_decodes, num_seqs)
            seq_lens = torch.tensor(metadata.seq_lens_cpu[num_decodes:], dtype=torch.int32)
            query_start_loc = torch.tensor([start - first_row for start in starts[num_decodes:num_seqs + 1]],
                                           dtype=torch.int32)
            inputs = (block_table, seq_lens, query_start_loc)
            metadata.backend_cache["cpu_native_prefill_inputs"] = inputs
        block_table, seq_lens, query_start_loc = inputs
        output[first_row:end_row] = paged_prefill_attention(query[first_row:end_row], kv_cache, block_table, seq_lens,
                                                            query_start_loc, scale, sliding_window)

    def _forward_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        output: torch.Tensor,
    ) -> None:
        if query.device.type != "cpu":
            raise ValueError(f"attention backend 'cpu_native' runs on the CPU only, got tensors on "
                             f"{query.device}; use attention_backend='torch_paged'")
        num_decodes = metadata.num_decodes
        block_table, seq_lens = decode_inputs(metadata)
        output[:num_decodes] = paged_decode_attention(query[:num_decodes], kv_cache, block_table, seq_lens, scale,
                                                      sliding_window)


def _int32_rows(block_table: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Rows [begin, end) of the block table as int32 with contiguous rows (what the kernels read)."""
    rows = block_table[begin:end].to(torch.int32)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _is_int32_rows(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.dtype == torch.int32 and tensor.is_contiguous()


def decode_inputs(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' block table and lengths as the int32 tensors the kernel reads; built once per step and
    shared by every layer."""
    key = ("cpu_native_decode_inputs", metadata.num_decodes)
    inputs = metadata.backend_cache.get(key)
    if inputs is None and metadata.num_decodes == metadata.num_seqs and _is_int32_rows(metadata.block_table) \
            and _is_int32_rows(metadata.seq_lens):
        # A decode-only step (the native decode stack's): the runner's tensors are the kernel's inputs as they are
        # (fewer torch calls; each costs tens of microseconds of a batch-1 decode step: models/native_decode_stack.py).
        inputs = (metadata.block_table, metadata.seq_lens)
        metadata.backend_cache[key] = inputs
    if inputs is None:
        block_table = _int32_rows(metadata.block_table, 0, metadata.num_decodes)
        seq_lens = torch.tensor(metadata.seq_lens_cpu[:metadata.num_decodes], dtype=torch.int32)
        inputs = (block_table, seq_lens)
        metadata.backend_cache[key] = inputs
    return inputs
