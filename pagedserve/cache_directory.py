"""Where pagedserve keeps what it builds once and reuses: native kernel builds, GGUF metadata and weights,
tokenizers, HF config snapshots, compiled graphs and the chat history.

One root for all of them, so a user (or a test) moves every cache with one variable:
$PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve.
"""
from __future__ import annotations

import os

CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"


def cache_root() -> str:
    """The pagedserve cache folder: $PAGEDSERVE_CACHE_DIR, $XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "pagedserve")
