"""CompilationConfig: which FX fusion passes run when the model forward is compiled.

Not yet an EngineConfig.create keyword: the passes act on the graph that graph capture (torch.compile)
produces, and the engine's forward is not compiled yet. Whoever wires capture builds this config from
the three knobs and hands it to `pagedserve.compilation.pass_manager.build_fusion_pass_manager`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompilationConfig:
    # residual add + RMSNorm (+ a following quantisation, once quantised models exist) -> one op
    fuse_norm_quant: bool = True
    # Qwen3-style per-head q/k RMSNorm + RoPE -> one op
    fuse_qknorm_rope: bool = True
    # x * scale + y -> one op
    fuse_muls_add: bool = True

    def __post_init__(self) -> None:
        for name in ("fuse_norm_quant", "fuse_qknorm_rope", "fuse_muls_add"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a bool (True or False)")


__all__ = ["CompilationConfig"]
