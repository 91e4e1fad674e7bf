"""CacheConfig: the paged KV cache (block size, capacity, prefix caching, the cache's dtype)."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}

# Share of the machine's available RAM that the KV cache takes when kv_cache_memory is not given.
DEFAULT_KV_CACHE_RAM_FRACTION = 0.25
# Never take more than this by default: a small model on a big box does not need 50 GiB of cache.
DEFAULT_KV_CACHE_MAX_BYTES = 8 * 1024**3

# kv_cache_dtype values this engine serves: "auto" stores K/V in the model's dtype; "int8" stores them as int8
# with a float32 scale per token and KV head in the same page (attention/kv_quantization.py).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "int8")


def parse_memory_size(value: int | str | None, field_name: str = "kv_cache_memory") -> int | None:
    """Parse bytes given as an int or a string such as '2GiB', '512MB', '1.5g'."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r} is not a size; give bytes or a string such as '2GiB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{field_name}={value!r} must be > 0 bytes")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{field_name}={value!r} is not a size; give bytes or a number with one of "
            f"{sorted(u for u in _UNITS if u)} such as '2GiB'"
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{field_name}={value!r} must be > 0 bytes")
    return size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; None -> DEFAULT_KV_CACHE_RAM_FRACTION of available RAM
    num_kv_blocks: int | None = None  # exact override (tests, tuning); wins over kv_cache_memory
    kv_cache_dtype: str = "auto"  # one of SUPPORTED_KV_CACHE_DTYPES (vLLM's knob; its fp8 variants are refused)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size={self.block_size!r} must be an integer in [1, 1024]")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 2 (one is the null block)")
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            # vLLM also takes fp8 / fp8_e4m3 / fp8_e5m2 / fp8_inc / fp8_ds_mla / bfloat16 ...: not served here.
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; supported: "
                             f"{list(SUPPORTED_KV_CACHE_DTYPES)}")

    @property
    def is_int8_kv_cache(self) -> bool:
        return self.kv_cache_dtype == "int8"
