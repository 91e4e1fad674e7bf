"""SparseKVOffloadConfig: sparse KV offload for DeepSeek sparse-attention models (vllm-ascend's
`sparse_kv_offload_config`; pagedserve/sparse_kv_offload/).

Each DSA layer's latent rows (the MLA KV) live in a second tier, a memory-mapped file on the CPU, addressed by the
same block ids as the resident cache; the resident cache keeps only the lightning indexer's keys (every decode
scores every past token). Per request and layer a resident buffer of `num_resident_blocks` blocks holds the blocks
the indexer selected lately (LRU); a decode copies in only the selected blocks it misses. See
docs/params-04-kv-and-sparsity.md.

Knobs (`sparse_kv_offload={...}`, `--sparse-kv-offload JSON`; None / absent: off):
- num_resident_blocks: the resident buffer's size in blocks, per request and layer (>= 1). Smaller than the blocks
  one step's top-k spans is allowed: that step then loads and gathers its blocks in several rounds.
- tier_directory: where the tier's file is created (default: the system's temporary directory); the file is
  unlinked as soon as it is mapped, so no exit (not even SIGKILL) leaves it behind. A RAM file system (tmpfs)
  is allowed with a warning: the tier then saves no memory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.config.knob_dict import config_from_dict

# The architectures whose layers run a lightning indexer (models/deepseek_v32.py, models/glm_moe_dsa.py).
SPARSE_ATTENTION_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass(frozen=True)
class SparseKVOffloadConfig:
    num_resident_blocks: int
    tier_directory: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_resident_blocks, bool) or not isinstance(self.num_resident_blocks, int) \
                or self.num_resident_blocks < 1:
            raise ValueError(f"sparse_kv_offload.num_resident_blocks={self.num_resident_blocks!r} must be an "
                             f"integer >= 1 (blocks per request and layer)")
        if self.tier_directory is not None:
            if not isinstance(self.tier_directory, str) or not self.tier_directory:
                raise ValueError(f"sparse_kv_offload.tier_directory={self.tier_directory!r} must be a non-empty "
                                 f"path string (or null: the system's temporary directory)")
            if not os.path.isdir(os.path.expanduser(self.tier_directory)):
                raise ValueError(f"sparse_kv_offload.tier_directory={self.tier_directory!r} is not an existing "
                                 f"directory")

    @staticmethod
    def parse(value: "SparseKVOffloadConfig | dict[str, Any] | str | None") -> "SparseKVOffloadConfig | None":
        """From a config, a dict, a JSON object string (the CLI form) or None (off)."""
        if value is None or isinstance(value, SparseKVOffloadConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"sparse_kv_offload={value!r} is not a JSON object: {error}") from None
        if isinstance(value, dict) and "num_resident_blocks" not in value:
            raise ValueError(f"sparse_kv_offload={value!r} must give num_resident_blocks (the resident buffer's "
                             f"blocks per request and layer)")
        return config_from_dict(SparseKVOffloadConfig, "sparse_kv_offload", value)

    def check_engine(self, *, architectures: list[str], kv_cache_dtype: str, device_type: str,
                     speculative_enabled: bool, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """ValueError naming sparse_kv_offload and the other knob when the engine cannot offload."""
        architecture = architectures[0] if architectures else "?"
        if architecture not in SPARSE_ATTENTION_ARCHITECTURES:
            raise ValueError(f"sparse_kv_offload needs a model whose attention runs a lightning indexer "
                             f"({', '.join(SPARSE_ATTENTION_ARCHITECTURES)}); {architecture} has none: drop "
                             f"sparse_kv_offload")
        if kv_cache_dtype != "auto":
            # As vllm-ascend refuses SFA C8 with sparse KV offload: the tier holds the plain latent rows.
            raise ValueError(f"sparse_kv_offload cannot be combined with kv_cache_dtype={kv_cache_dtype!r} (an "
                             f"int8 / C8 cache); use kv_cache_dtype='auto' or drop sparse_kv_offload")
        if device_type != "cpu":
            raise ValueError(f"sparse_kv_offload is implemented for the CPU platform only so far (this is "
                             f"{device_type}); drop sparse_kv_offload")
        if speculative_enabled:
            raise ValueError("sparse_kv_offload cannot be combined with speculative_config (verification steps "
                             "are not offloaded yet); drop one of them")
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
            raise ValueError(f"sparse_kv_offload needs tensor_parallel_size=1 and pipeline_parallel_size=1 (got "
                             f"{tensor_parallel_size} and {pipeline_parallel_size}): several worker ranks are "
                             f"not supported with it yet")


__all__ = ["SPARSE_ATTENTION_ARCHITECTURES", "SparseKVOffloadConfig"]
