"""A transformers model config's attribute values, recorded once and read back without importing its class.

Importing a model config class of transformers 5 (LlamaConfig, Qwen2Config, ...) imports most of its modelling
stack with it (torch.distributed.tensor, accelerate, sympy): ~3 s of a warm `pagedserve chat` start on a 2-core
machine, and more at exit. A GGUF model's config is a pure function of the constructor fields its metadata gives
(gguf_loader.hf_config_fields) and of the installed transformers. So the first start builds the real config and
records, in the cache folder, the value of every attribute that survives JSON exactly; a later start with the same
class, fields and transformers version gets a `ConfigSnapshot` holding those values instead.

A snapshot reads like the config it recorded: a recorded attribute has the recorded value; a name the config does
not have raises AttributeError (so `getattr(config, name, default)` gives the default, as on the real one); any
other attribute (a method such as to_dict(), a property left unrecorded, a value JSON cannot hold) builds the real
config at that moment and is read from it. Only its type differs. Entries are named by a hash of what they depend
on (class, fields, transformers version, FORMAT_VERSION), so they never go stale; a missing or unreadable entry
just means the real config is built (and the entry written again).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
from typing import Any

from pagedserve.model_loader.gguf_cache import _write_atomically, cache_root

logger = logging.getLogger(__name__)

# Bump when what a snapshot records, or how, changes.
FORMAT_VERSION = 1
# Properties recorded besides the instance and class attributes: those pagedserve reads
# (models/llama.py and layers/rotary.py read rope_scaling). Other properties build the real config when read.
RECORDED_PROPERTIES = ("rope_scaling",)


def build_config(class_name: str, fields: dict[str, Any]) -> Any:
    """The real transformers config: `transformers.<class_name>(**fields)`."""
    return getattr(importlib.import_module("transformers"), class_name)(**fields)


class ConfigSnapshot:
    """Recorded attribute values of `transformers.<class_name>(**fields)`; see the module docstring."""

    def __init__(self, class_name: str, fields: dict[str, Any], values: dict[str, Any], names: list[str]) -> None:
        state = self.__dict__
        state.update(values)
        # Stored under names no config attribute has ('__' prefix, not mangled in __dict__ keys).
        state["__class_name"] = class_name
        state["__fields"] = fields
        state["__names"] = frozenset(names)
        state["__config"] = None

    def _real_config(self) -> Any:
        state = self.__dict__
        if state["__config"] is None:
            logger.debug("building the %s a config snapshot stands for", state["__class_name"])
            state["__config"] = build_config(state["__class_name"], state["__fields"])
        return state["__config"]

    def __getattr__(self, name: str) -> Any:
        # Called only for names not recorded in __dict__.
        state = self.__dict__
        if name.startswith("__") or "__names" not in state:
            raise AttributeError(name)
        if name not in state["__names"]:
            raise AttributeError(f"'{state['__class_name']}' object has no attribute '{name}'")
        return getattr(self._real_config(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real_config(), name, value)
        self.__dict__[name] = value

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__dict__
        values = {name: value for name, value in state.items() if not name.startswith("__")}
        return ConfigSnapshot, (state["__class_name"], state["__fields"], values, sorted(state["__names"]))

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self.__dict__['__class_name']}, {self.__dict__['__fields']!r})"


def _is_json_exact(value: Any) -> bool:
    """True when json.loads(json.dumps(value)) gives back an equal value of the same types."""
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, int):
        return type(value) is int
    if isinstance(value, float):
        return type(value) is float and value == value and value not in (float("inf"), float("-inf"))
    if type(value) is list:
        return all(_is_json_exact(item) for item in value)
    if type(value) is dict:
        return all(type(key) is str and _is_json_exact(item) for key, item in value.items())
    return False


def record(config: Any) -> tuple[dict[str, Any], list[str]]:
    """(values, names) of a real config: the attributes a snapshot answers itself, and every name it has."""
    names = [name for name in dir(config) if not (name.startswith("__") and name.endswith("__"))]
    values: dict[str, Any] = {}
    for name in names:
        static = inspect.getattr_static(config, name)
        if isinstance(static, property) and name not in RECORDED_PROPERTIES:
            continue
        if not isinstance(static, (property, type(None), bool, int, float, str, list, dict)):
            continue  # methods, class properties and other descriptors: read from the real config
        value = getattr(config, name)
        if _is_json_exact(value):
            values[name] = value
    return values, names


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def snapshot_path(class_name: str, fields: dict[str, Any], transformers_version: str,
                  root: str | None = None) -> str:
    key = json.dumps({"format_version": FORMAT_VERSION, "class": class_name, "fields": fields,
                      "transformers_version": transformers_version}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return os.path.join(root or os.path.join(cache_root(), "hf_configs"), f"{class_name}-{digest}.json")


def load_config(class_name: str, fields: dict[str, Any], root: str | None = None) -> Any:
    """A snapshot of `transformers.<class_name>(**fields)` when one was recorded for the installed transformers;
    else the real config, recorded for next time (a failure to write only logs)."""
    version = _transformers_version()
    if version is None or not _is_json_exact(fields):
        return build_config(class_name, fields)
    path = snapshot_path(class_name, fields, version, root)
    try:
        with open(path, "rb") as f:
            stored = json.load(f)
        if stored["class"] == class_name and stored["fields"] == fields and \
                stored["transformers_version"] == version:
            return ConfigSnapshot(class_name, fields, stored["values"], stored["names"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        pass  # no entry yet, or an unreadable one: built and written below
    config = build_config(class_name, fields)
    if getattr(config, "attribute_map", None) or getattr(config, "is_heterogeneous", False):
        return config  # aliased or per-layer attributes: always the real config
    values, names = record(config)
    document = {"format_version": FORMAT_VERSION, "class": class_name, "fields": fields,
                "transformers_version": version, "values": values, "names": names}
    try:
        _write_atomically(path, json.dumps(document, sort_keys=True).encode())
    except (OSError, TypeError, ValueError) as error:
        logger.warning("config snapshot: cannot write %s (%s)", path, error)
    return config
