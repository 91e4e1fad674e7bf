"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's architecture (models/deepseek_v32.py) with two differences:
the indexer rotates its rope part as interleaved pairs, and `indexer_types` lets "shared" layers reuse the
previous full layer's top-k selection instead of running an indexer of their own."""
from __future__ import annotations

from pagedserve.models.deepseek_v32 import DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    indexer_rope_interleave = True


__all__ = ["GlmMoeDsaForCausalLM"]
