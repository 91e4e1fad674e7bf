"""compressed-tensors quantization_config dicts for the W8A8 tests."""
from __future__ import annotations

from typing import Any

_INT8 = dict(num_bits=8, type="int", symmetric=True)


def w8a8_config(*, static: bool = False, weight_strategy: str = "channel", ignore: list[str] | None = None,
                **group_overrides: Any) -> dict[str, Any]:
    inputs = dict(_INT8, strategy="tensor", dynamic=False) if static else dict(_INT8, strategy="token", dynamic=True)
    group: dict[str, Any] = dict(targets=["Linear"], weights=dict(_INT8, strategy=weight_strategy, dynamic=False),
                                 input_activations=inputs)
    group.update(group_overrides)
    return dict(quant_method="compressed-tensors", format="int-quantized", quantization_status="compressed",
                config_groups={"group_0": group}, ignore=["lm_head"] if ignore is None else ignore)
