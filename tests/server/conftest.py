"""Fixtures for server tests: the tiny llama model folder and the engine flags every server uses."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Small enough for 2 CPU cores: a 2048-token context (long enough that a request can be caught
# mid-stream) and a 3072-token KV cache.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", "192", "--block-size", "16"]
ENGINE_KWARGS = dict(dtype="float32", max_model_len=2048, num_kv_blocks=192, block_size=16)
MAX_MODEL_LEN = 2048
