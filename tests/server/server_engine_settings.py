"""The engine flags every server test starts its server with (imported by name: a module called conftest would
clash with other folders' conftests when several test folders run in one pytest command)."""
from __future__ import annotations

# Small enough for 2 CPU cores: a 2048-token context (long enough that a request can be caught
# mid-stream) and a 3072-token KV cache.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", "192", "--block-size", "16"]
ENGINE_KWARGS = dict(dtype="float32", max_model_len=2048, num_kv_blocks=192, block_size=16)
MAX_MODEL_LEN = 2048
