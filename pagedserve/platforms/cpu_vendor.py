"""Which vendor made this CPU (/proc/cpuinfo's vendor_id): the layouts 'auto' picks depend on whose GEMM is fastest.

MKL's sgemm, which F.linear calls for float32 on x86, is tuned for Intel CPUs; on AMD Zen 4 oneDNN's packed
float32 GEMM ran 1.1-1.3x faster from 16 to 2048 rows and 1.9x for a 49152-column LM head at 64 rows
(layers/weight_layout.py, docs/params-06-weight-loading.md).
"""
from __future__ import annotations

import functools

CPUINFO_PATH = "/proc/cpuinfo"
INTEL_VENDOR_ID = "GenuineIntel"


def cpu_vendor_id(path: str = CPUINFO_PATH) -> str | None:
    """The first vendor_id in `path` ('GenuineIntel', 'AuthenticAMD', ...), or None where the file has none
    (not Linux, not x86)."""
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        return None
    return None


@functools.cache
def is_intel_cpu() -> bool:
    return cpu_vendor_id() == INTEL_VENDOR_ID


__all__ = ["cpu_vendor_id", "is_intel_cpu"]
