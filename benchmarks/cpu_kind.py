"""The CPU kind a benchmark result is filed under, named from /proc/cpuinfo: `<family>-<isa>`.

family  the microarchitecture from the vendor, family and model fields (zen, zen2, zen3, zen4, zen5;
        sapphirerapids, emeraldrapids, graniterapids, icelake, skylake, ...; neoverse-n1, ...), or the raw
        numbers where the table below does not know them (amd-family25-model200, intel-family6-model190, ...).
        A VM reports what its hypervisor passes through, so the name is the guest's view.
isa     the best of amx, avx512bf16, avx512, avx2, neon the CPU reports, else "base".

The recipes write their results to results/<recipe>_<dtype>_<cpu kind>.json (result_path), so every CPU kind
keeps one result per recipe and dtype. Print this machine's kind:

    python benchmarks/cpu_kind.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# AMD family -> [(first model, last model, name)]: Zen 1 to Zen 5 (families 0x17, 0x19, 0x1a).
_AMD = {
    0x17: [(0x00, 0x2F, "zen"), (0x30, 0xFF, "zen2")],
    0x19: [(0x00, 0x0F, "zen3"), (0x10, 0x1F, "zen4"), (0x20, 0x5F, "zen3"), (0x60, 0x7F, "zen4"),
           (0xA0, 0xAF, "zen4")],
    0x1A: [(0x00, 0xFF, "zen5")],
}
# Intel family 6 model -> name (server parts first; client parts by their core's name).
_INTEL = {
    0x3F: "haswell", 0x3C: "haswell", 0x45: "haswell", 0x46: "haswell",
    0x4F: "broadwell", 0x56: "broadwell", 0x3D: "broadwell", 0x47: "broadwell",
    0x55: "skylake", 0x4E: "skylake", 0x5E: "skylake", 0x8E: "skylake", 0x9E: "skylake",
    0x6A: "icelake", 0x6C: "icelake", 0x7D: "icelake", 0x7E: "icelake",
    0x8F: "sapphirerapids", 0xCF: "emeraldrapids", 0xAD: "graniterapids", 0xAE: "graniterapids",
    0xAF: "sierraforest", 0x97: "alderlake", 0x9A: "alderlake", 0xB7: "raptorlake", 0xBA: "raptorlake",
    0xBF: "raptorlake", 0xAA: "meteorlake", 0xAC: "meteorlake",
}
# Arm (implementer, part) -> name.
_ARM = {
    (0x41, 0xD0C): "neoverse-n1", (0x41, 0xD40): "neoverse-v1", (0x41, 0xD49): "neoverse-n2",
    (0x41, 0xD4F): "neoverse-v2", (0x41, 0xD8E): "neoverse-n3", (0x41, 0xD84): "neoverse-v3",
    (0xC0, 0xAC3): "ampereone",
}


def _fields(text: str) -> dict[str, str]:
    """The first processor's `key : value` lines."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _number(value: str | None) -> int | None:
    try:
        return int(value, 0) if value is not None else None
    except ValueError:
        return None


def _family(fields: dict[str, str]) -> str:
    vendor = fields.get("vendor_id", "")
    family, model = _number(fields.get("cpu family")), _number(fields.get("model"))
    if vendor == "AuthenticAMD" and family is not None and model is not None:
        for first, last, name in _AMD.get(family, []):
            if first <= model <= last:
                return name
        return f"amd-family{family}-model{model}"
    if vendor == "GenuineIntel" and family is not None and model is not None:
        return _INTEL.get(model, f"intel-family{family}-model{model}") if family == 6 else \
            f"intel-family{family}-model{model}"
    implementer, part = _number(fields.get("cpu implementer")), _number(fields.get("cpu part"))
    if implementer is not None and part is not None:
        return _ARM.get((implementer, part), f"arm-{implementer:#x}-{part:#x}")
    return (platform.machine() or "unknown").lower()


def _isa(fields: dict[str, str]) -> str:
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    if "asimd" in flags:  # Arm's name for NEON in /proc/cpuinfo
        return "neon"
    return "base"


def cpu_kind(cpuinfo: str | None = None) -> str:
    """`<family>-<isa>` of this machine (or of the given /proc/cpuinfo text), e.g. zen4-avx512bf16."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = _fields(cpuinfo)
    return f"{_family(fields)}-{_isa(fields)}"


def result_path(recipe: str, dtype: str, kind: str | None = None) -> str:
    """results/<recipe>_<dtype>_<cpu kind>.json: where a recipe's run on this CPU kind is kept."""
    return os.path.join(RESULTS, f"{recipe}_{dtype}_{kind or cpu_kind()}.json")


def write_result_file(results: object, path: str) -> None:
    """The recipe's results as JSON at `path` (result_path's, or the --json-out the user gave)."""
    with open(path, "w") as handle:
        json.dump(results, handle, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(cpu_kind())
