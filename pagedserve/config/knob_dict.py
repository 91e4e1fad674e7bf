"""Config classes built from a dict of knobs, or its JSON text (the command-line form), with unknown keys named."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

ConfigType = TypeVar("ConfigType")


def config_from_dict(cls: type[ConfigType], name: str, value: Any) -> ConfigType:
    """`cls(**value)` from a dict or a JSON object string; `name` is the knob's place, for error messages."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name}={value!r} is not a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict or a JSON object string")
    allowed = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; allowed: {allowed}")
    return cls(**value)
