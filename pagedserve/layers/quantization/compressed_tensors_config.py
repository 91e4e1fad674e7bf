"""A checkpoint's compressed-tensors `quantization_config` (config.json), parsed with the compressed-tensors
package's own classes, and the linear method it gives each layer.

Supported (what vLLM's compressed-tensors loader calls W8A8 int8, format 'int-quantized'): config groups whose
weights are 8-bit symmetric int with a 'channel' (or 'tensor') strategy and static, and whose input activations are
8-bit symmetric int, either 'token' + dynamic or 'tensor' + static. Anything else (4-bit, fp8, asymmetric, weight-only,
group-wise, output activations, a KV-cache scheme, another quant_method or format) is a ValueError naming the group,
the field and the value, raised before any layer is built.

MoE experts (FusedMoE) are quantized when all their projections fall in one dynamic per-channel group.

A layer gets the scheme of the first group whose targets match it ('Linear' matches every linear; otherwise an
exact module name or 're:<regex>', compressed-tensors' `match_name`) unless a name in `ignore` matches it. A fused
layer (qkv_proj, gate_up_proj) is matched through its checkpoint parts (the model's packed_modules_mapping); its
parts must agree (all ignored, or all one group).
"""
from __future__ import annotations

from typing import Any

from pagedserve.layers.linear import LinearMethodBase
from pagedserve.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod

SUPPORTED_QUANT_METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("int-quantized",)
SCALE_SUFFIXES = (".weight_scale", ".input_scale")
# vLLM's fused modules; a model's own packed_modules_mapping extends it.
DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def _field(value: Any) -> Any:
    """An enum field of compressed-tensors' models as its plain value."""
    return getattr(value, "value", value)


class CompressedTensorsConfig:
    """The validated quantization_config of one checkpoint (see the module docstring)."""

    def __init__(self, config: Any, packed_modules: dict[str, list[str]] | None = None) -> None:
        # `config`: compressed_tensors.quantization.QuantizationConfig, already validated by `from_dict`.
        self.config = config
        self.packed_modules = dict(DEFAULT_PACKED_MODULES)
        self.packed_modules.update(packed_modules or {})
        # group name -> the method its layers share.
        self._methods: dict[str, W8A8Int8LinearMethod] = {}
        for group_name, scheme in config.config_groups.items():
            self._methods[group_name] = W8A8Int8LinearMethod(
                is_static_input=not scheme.input_activations.dynamic,
                is_per_tensor_weight=_field(scheme.weights.strategy) == "tensor")

    # ---- parsing ------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf_config: Any,
                       packed_modules: dict[str, list[str]] | None = None) -> "CompressedTensorsConfig | None":
        """The config of `hf_config.quantization_config`, None when the checkpoint is not quantized."""
        raw = getattr(hf_config, "quantization_config", None)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
        return cls.from_dict(raw, packed_modules)

    @classmethod
    def from_dict(cls, raw: dict[str, Any],
                  packed_modules: dict[str, list[str]] | None = None) -> "CompressedTensorsConfig":
        quant_method = raw.get("quant_method")
        if quant_method != SUPPORTED_QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method={quant_method!r} is not supported: pagedserve loads "
                             f"{SUPPORTED_QUANT_METHOD!r} checkpoints (W8A8 int8, format 'int-quantized')")
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            config = QuantizationConfig.model_validate(raw)
        except (ValidationError, KeyError, ValueError) as error:
            raise ValueError(f"quantization_config is not a valid compressed-tensors config: {error}") from error
        cls._check_supported(config)
        return cls(config, packed_modules)

    @staticmethod
    def _check_supported(config: Any) -> None:
        if _field(config.format) not in SUPPORTED_FORMATS:
            raise ValueError(f"quantization_config.format={_field(config.format)!r} is not supported; supported: "
                             f"{list(SUPPORTED_FORMATS)} (W8A8 int8)")
        if config.kv_cache_scheme is not None:
            raise ValueError("quantization_config.kv_cache_scheme is set; the compressed-tensors loader supports W8A8 "
                             "linear layers only (no quantized KV cache from the checkpoint)")
        if not config.config_groups:
            raise ValueError("quantization_config.config_groups is empty")
        for group_name, scheme in config.config_groups.items():
            where = f"quantization_config.config_groups.{group_name}"
            if scheme.format is not None and _field(scheme.format) not in SUPPORTED_FORMATS:
                raise ValueError(f"{where}.format={_field(scheme.format)!r} is not supported; supported: "
                                 f"{list(SUPPORTED_FORMATS)}")
            weights, inputs = scheme.weights, scheme.input_activations
            if weights is None:
                raise ValueError(f"{where}.weights is missing: activation-only quantization is not supported")
            if inputs is None:
                raise ValueError(f"{where}.input_activations is missing: weight-only schemes (W{weights.num_bits}A16) "
                                 f"are not supported; supported: W8A8 int8")
            if scheme.output_activations is not None:
                raise ValueError(f"{where}.output_activations is set; output quantization is not supported")
            for field, args in (("weights", weights), ("input_activations", inputs)):
                if args.num_bits != 8 or _field(args.type) != "int":
                    raise ValueError(f"{where}.{field}: num_bits={args.num_bits} type={_field(args.type)!r} is not "
                                     f"supported; supported: num_bits=8 type='int' (W8A8 int8)")
                if not args.symmetric:
                    raise ValueError(f"{where}.{field}.symmetric=False is not supported (symmetric int8 only)")
            weight_strategy = _field(weights.strategy)
            if weight_strategy not in ("channel", "tensor") or weights.dynamic:
                raise ValueError(f"{where}.weights.strategy={weight_strategy!r} dynamic={weights.dynamic!r} is not "
                                 f"supported; supported: strategy 'channel' or 'tensor', dynamic false")
            input_strategy, dynamic = _field(inputs.strategy), _field(inputs.dynamic)
            if (input_strategy, dynamic) not in (("token", True), ("tensor", False)):
                raise ValueError(f"{where}.input_activations.strategy={input_strategy!r} dynamic={dynamic!r} is not "
                                 f"supported; supported: 'token' with dynamic true, or 'tensor' with dynamic false")

    @staticmethod
    def is_scale_tensor(name: str) -> bool:
        """Whether the checkpoint tensor `name` is a quantization scale (loaded in its file dtype, not the model's:
        the scale parameters are float32)."""
        return name.endswith(SCALE_SUFFIXES)

    # ---- per layer ----------------------------------------------------------------------------------------
    def _parts(self, prefix: str) -> list[str]:
        """The checkpoint module names a (possibly fused) layer named `prefix` loads."""
        head, _, last = prefix.rpartition(".")
        parts = self.packed_modules.get(last)
        if parts is None:
            return [prefix]
        return [f"{head}.{part}" if head else part for part in parts]

    def _group_of_name(self, name: str) -> str | None:
        from compressed_tensors.utils.match import match_name

        if any(match_name(name, ignored) for ignored in (self.config.ignore or [])):
            return None
        for group_name, scheme in self.config.config_groups.items():
            if any(target == "Linear" or match_name(name, target) for target in scheme.targets):
                return group_name
        return None

    def group_of(self, prefix: str) -> str | None:
        """The config group quantizing the layer named `prefix`, None when it stays unquantized."""
        parts = self._parts(prefix)
        groups = {part: self._group_of_name(part) for part in parts}
        if len(set(groups.values())) > 1:
            raise ValueError(f"{prefix}: the parts of this fused layer are quantized differently ({groups}); "
                             f"pagedserve fuses them into one layer, so quantization_config must treat them alike")
        return groups[parts[0]]

    def linear_method(self, prefix: str) -> LinearMethodBase | None:
        group = self.group_of(prefix)
        return None if group is None else self._methods[group]

    def experts_are_quantized(self, prefix: str) -> bool:
        """Whether the routed experts named `prefix` (checkpoint `<prefix>.<E>.<projection>`) are quantized: all of
        their projections in one dynamic group (W8A8 experts run per-token dynamic activations), or none."""
        projections = {f"{prefix}.0.{projection}": None for projection in ("gate_proj", "up_proj", "down_proj")}
        groups = {name: self._group_of_name(name) for name in projections}
        if len(set(groups.values())) > 1:
            raise ValueError(f"{prefix}: the expert projections are quantized differently ({groups}); pagedserve "
                             f"stacks them, so quantization_config must treat them alike")
        group = next(iter(groups.values()))
        if group is None:
            return False
        if self._methods[group].is_static_input or self._methods[group].is_per_tensor_weight:
            raise ValueError(f"{prefix}: W8A8 MoE experts need per-channel weight scales and dynamic per-token "
                             f"activations; quantization_config.config_groups.{group} has "
                             f"{'static activations' if self._methods[group].is_static_input else 'per-tensor weights'}"
                             f" (list the experts in quantization_config.ignore, or quantize them dynamically)")
        return True

    def check_lm_head(self, name: str = "lm_head") -> None:
        """The LM head is not a quantizable layer: refuse a config that quantizes it."""
        if self._group_of_name(name) is not None:
            raise ValueError(f"quantization_config quantizes {name!r}; pagedserve keeps the LM head in the model "
                             f"dtype: add {name!r} to quantization_config.ignore")


__all__ = ["CompressedTensorsConfig", "DEFAULT_PACKED_MODULES", "SUPPORTED_FORMATS", "SUPPORTED_QUANT_METHOD"]
