"""LoadConfig: how checkpoint weights are read, and the layout linear weights take after loading.

vLLM's names: `enable_multithread_load` / `num_threads` (upstream's model_loader_extra_config keys),
`safetensors_load_strategy`; `weight_layout` is the portable analogue of Ascend's weight NZ mode
(`weight_nz_mode`). See pagedserve/model_loader/load_strategies.py, pagedserve/layers/weight_layout.py
and docs/params-06-weight-loading.md.
"""
from __future__ import annotations

from dataclasses import dataclass

SAFETENSORS_LOAD_STRATEGIES = ("lazy", "eager", "prefetch")
WEIGHT_LAYOUTS = ("auto", "plain", "prepacked", "plain_native", "amx_packed")
# A generous ceiling: more reader threads than this only adds contention.
MAX_LOAD_THREADS = 256


@dataclass(frozen=True)
class LoadConfig:
    # Read (and convert) checkpoint tensors in a pool of `num_threads` threads.
    enable_multithread_load: bool = False
    # Threads of that pool (upstream's default is 8); ignored unless enable_multithread_load.
    num_threads: int = 8
    # 'lazy': memory-map each file (safe_open) and read a tensor when it is loaded;
    # 'eager': read each whole file into memory first (fewer, larger reads: network file systems);
    # 'prefetch': lazy, while a background thread reads the next shard files ahead into the page cache.
    safetensors_load_strategy: str = "lazy"
    # After loading, linear weights take the layout the platform's GEMM prefers:
    # 'plain' keeps [out, in]; 'prepacked' uses the platform's packed layout (oneDNN blocked on the CPU);
    # 'plain_native' keeps [out, in] float32 and runs decode-sized batches on a native CPU kernel;
    # 'amx_packed' packs bfloat16 weights for the native tile-packed kernel (CPUs with AMX or AVX512-BF16);
    # 'auto' picks 'amx_packed' or else 'prepacked' (CPU, bfloat16) or 'plain_native' (CPU, float32) where
    # they were measured faster and 'plain' elsewhere.
    weight_layout: str = "auto"
    # After the layout transform, move the weights into one arena on transparent huge pages where the
    # platform has them (the CPU: platforms/huge_page_weights.py); False keeps them where loading put them.
    huge_page_weights: bool = True
    # A .gguf file's quantized weights are kept in their blocks and computed on the fly (layers/gguf_linear.py);
    # True dequantizes every weight to the model dtype at load instead.
    gguf_dequantize: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_multithread_load, bool):
            raise ValueError(f"enable_multithread_load={self.enable_multithread_load!r} must be true or false")
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int) \
                or not 1 <= self.num_threads <= MAX_LOAD_THREADS:
            raise ValueError(f"num_threads={self.num_threads!r} must be an integer in [1, {MAX_LOAD_THREADS}]")
        if self.safetensors_load_strategy not in SAFETENSORS_LOAD_STRATEGIES:
            raise ValueError(f"safetensors_load_strategy={self.safetensors_load_strategy!r} must be one of "
                             f"{list(SAFETENSORS_LOAD_STRATEGIES)}")
        if not isinstance(self.gguf_dequantize, bool):
            raise ValueError(f"gguf_dequantize={self.gguf_dequantize!r} must be true or false")
        if not isinstance(self.huge_page_weights, bool):
            raise ValueError(f"huge_page_weights={self.huge_page_weights!r} must be true or false")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout={self.weight_layout!r} must be one of {list(WEIGHT_LAYOUTS)}")

    @property
    def num_load_threads(self) -> int:
        """Threads that read the checkpoint (1 unless multithreaded loading is on)."""
        return self.num_threads if self.enable_multithread_load else 1


__all__ = ["LoadConfig", "SAFETENSORS_LOAD_STRATEGIES", "WEIGHT_LAYOUTS"]
