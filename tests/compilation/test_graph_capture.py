"""Graph capture: compiled forward == eager forward (float32 greedy tokens), padding to the ladder, the
attention split, fusion passes firing inside the engine, enforce_eager, fallback, cache reuse, config errors.

Most engines here use `backend="eager"`: Dynamo capture, the attention split, padding and the fusion
passes all run, but the captured graph executes as Python instead of going through Inductor's C++
code generation (minutes on a loaded 2-core box). One test builds Inductor engines (equality + cache).
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedserve import LLM, SamplingParams
from generation_helpers import generated_token_ids, random_prompts
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.compilation.attention_op import attention_layers_in_use
from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
from pagedserve.config.compilation import CompilationConfig, default_capture_sizes
from pagedserve.worker.compiled_forward import CompiledForward, padded_size

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Dynamo keeps compiled frames per code object (every engine's model forward shares one) and counts
    recompiles across engines: without a reset, a test's outcome would depend on how many engines the tests
    before it compiled."""
    torch._dynamo.reset()
LADDER = [2, 4, 8, 16]


def _prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    return random_prompts(num, low, high, seed)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return generated_token_ids(llm, prompts, GREEDY)


def _engine(folder: str, compilation: dict | None = None, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 64)
    return LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=96, compilation_config=compilation,
               **kwargs)


def _forward(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.forward


def _compiled(cache_dir, **fields) -> dict:
    return {"mode": "compile", "backend": "eager", "cudagraph_capture_sizes": LADDER, "cache_dir": str(cache_dir),
            **fields}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_equals_eager_with_padding(kind: str, tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir(kind)
    # 5 and 3 concurrent decodes: batch sizes off the ladder (padded to 8 and 4); prompts above 16
    # tokens prefill eagerly.
    prompts = _prompts(5, 3, 30, seed=1)
    expected = _generate(_engine(folder, enforce_eager=True), prompts)
    llm = _engine(folder, _compiled(tmp_path))
    forward = _forward(llm)
    assert isinstance(forward, CompiledForward) and forward.is_compiled
    assert _generate(llm, prompts) == expected
    assert forward.num_compiled_steps >= 31 and forward.num_eager_steps >= 1  # 31 decode steps
    assert forward.stats.num_graphs == 1  # one trace served every size: no silent recompiles
    replacements = forward.stats.num_replacements
    assert replacements["fuse_norm_quant"] == 4  # 2 layers x (post-attention norm + next/final norm)
    assert replacements["fuse_qknorm_rope"] == (2 if kind == "qwen3" else 0)
    assert replacements["fuse_muls_add"] == 0  # no `x * scale + y` in these models
    assert _generate(llm, prompts[:3]) == expected[:3]  # 3 decodes -> padded to 4


def test_chunked_prefill_mixed_batches_all_compiled(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("qwen3")
    prompts = _prompts(4, 10, 40, seed=2)
    expected = _generate(_engine(folder, enforce_eager=True, max_num_batched_tokens=16), prompts)
    llm = _engine(folder, _compiled(tmp_path), max_num_batched_tokens=16)
    assert _generate(llm, prompts) == expected
    forward = _forward(llm)
    # Every step (prefill chunks mixed with decodes) fits the 16-token ladder top.
    assert forward.num_eager_steps == 0 and forward.num_compiled_steps >= 32
    assert forward.stats.num_graphs == 1


def test_fusion_flags_off_no_replacements_same_tokens(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("qwen3")
    prompts = _prompts(3, 3, 12, seed=3)
    fused = _engine(folder, _compiled(tmp_path))
    unfused = _engine(folder, _compiled(tmp_path, fuse_norm_quant=False, fuse_qknorm_rope=False,
                                        fuse_muls_add=False))
    assert _forward(unfused).stats.num_replacements == {}
    assert _forward(fused).stats.num_replacements["fuse_qknorm_rope"] == 2
    assert _generate(fused, prompts) == _generate(unfused, prompts)


def test_static_shapes_compile_once_per_size(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("qwen3")
    prompts = _prompts(3, 3, 12, seed=6)
    llm = _engine(folder, _compiled(tmp_path, dynamic_shapes=False, cudagraph_capture_sizes=[1, 2, 4]))
    forward = _forward(llm)
    assert forward.is_compiled and forward.stats.num_graphs == 3  # sizes 1, 2 and 4, each static
    # Literal-size form of the q/k pass: 2 layers x sizes 2 and 4 (size 1's graph is spelled differently).
    assert forward.stats.num_replacements["fuse_qknorm_rope"] == 4
    assert forward.stats.num_replacements["fuse_norm_quant"] == 12
    assert _generate(llm, prompts) == _generate(_engine(folder, enforce_eager=True), prompts)
    assert forward.stats.num_graphs == 3 and forward.num_compiled_steps >= 31


def test_enforce_eager_and_mode_none_run_the_model(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("llama")
    eager = _engine(folder, _compiled(tmp_path), enforce_eager=True)
    assert not isinstance(_forward(eager), CompiledForward)
    assert eager.llm_engine.config.compilation_config.mode == "none"
    none_mode = _engine(folder, {"level": 0})
    assert not isinstance(_forward(none_mode), CompiledForward)


def test_capture_failure_falls_back_to_eager_with_warning(tiny_model_dir, tmp_path, monkeypatch, caplog) -> None:
    from pagedserve.compilation.compiler_backend import CompilerBackend

    def failing_backend(self, graph_module, example_inputs):
        raise NotImplementedError("an op this backend cannot compile")

    monkeypatch.setattr(CompilerBackend, "__call__", failing_backend)
    folder = tiny_model_dir("llama")
    prompts = _prompts(2, 3, 10, seed=4)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.compiled_forward"):
        llm = _engine(folder, _compiled(tmp_path))
    assert "graph capture failed for LlamaForCausalLM" in caplog.text
    forward = _forward(llm)
    assert isinstance(forward, CompiledForward) and not forward.is_compiled
    assert _generate(llm, prompts) == _generate(_engine(folder, enforce_eager=True), prompts)
    assert forward.num_compiled_steps == 0


def test_capture_succeeds_before_any_layer_checked_the_native_kernels(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The layers' first call loads the native kernels under a lock, which Dynamo cannot trace: capture runs one
    eager forward first (in a fresh process the first forward used to be the traced one, and capture fell back
    to eager)."""
    from pagedserve.kernels import elementwise as native_elementwise

    monkeypatch.setattr(native_elementwise, "_available", None)  # as in a fresh process
    llm = _engine(tiny_model_dir("llama"), _compiled(tmp_path))
    assert _forward(llm).is_compiled


class RecordingLayer(nn.Module):
    """Stands in for an Attention layer: records the rows it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_rows: list[int] = []

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.seen_rows.append(query.shape[0])
        return query * 2 + key.sum(-1, keepdim=True)


def _metadata(num_actual_tokens: int) -> AttentionMetadata:
    return AttentionMetadata(num_actual_tokens=num_actual_tokens, slot_mapping=torch.arange(num_actual_tokens),
                             query_start_loc=torch.tensor([0, num_actual_tokens]), seq_lens=torch.tensor([9]),
                             block_table=torch.zeros(1, 1, dtype=torch.int32), max_query_len=num_actual_tokens,
                             max_seq_len=9, num_decodes=0, num_decode_tokens=0,
                             query_start_loc_cpu=[0, num_actual_tokens], seq_lens_cpu=[9], block_size=16)


def test_attention_op_hands_backends_only_real_rows() -> None:
    layer = RecordingLayer()
    query, key, value = torch.randn(8, 6), torch.randn(8, 6), torch.randn(8, 6)
    with attention_layers_in_use({"layer": layer}), set_forward_context(_metadata(5)):
        output = torch.ops.pagedserve.attention(query, key, value, "layer")
    assert layer.seen_rows == [5]  # padded rows never reach a backend (so never write KV)
    assert torch.equal(output[:5], query[:5] * 2 + key[:5].sum(-1, keepdim=True))
    assert torch.equal(output[5:], torch.zeros(3, 6))
    with attention_layers_in_use({"layer": layer}), set_forward_context(None):  # capture runs: every row
        torch.ops.pagedserve.attention(query, key, value, "layer")
    assert layer.seen_rows == [5, 8]
    with pytest.raises(RuntimeError, match="outside attention_layers_in_use"), set_forward_context(None):
        torch.ops.pagedserve.attention(query, key, value, "layer")


def test_padded_size_and_ladder() -> None:
    assert padded_size(1, LADDER) == 2 and padded_size(3, LADDER) == 4 and padded_size(16, LADDER) == 16
    assert padded_size(17, LADDER) is None
    ladder = default_capture_sizes(512)
    assert ladder[:5] == (1, 2, 4, 8, 16) and ladder[-1] == 512 and list(ladder) == sorted(set(ladder))
    assert default_capture_sizes(100)[-1] == 100
    resolved = CompilationConfig().resolve(max_num_batched_tokens=64, enforce_eager=False, device_type="cpu")
    assert resolved.capture_sizes[-1] == 64 and resolved.cache_dir.endswith("compile")


def test_cli_flags_reach_engine_kwargs() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enforce-eager", "--compilation-config", '{"mode": 3, "cudagraph_capture_sizes": [1, 2]}'])
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["enforce_eager"] is True
    parsed = CompilationConfig.parse(kwargs["compilation_config"])
    assert parsed.mode == "compile" and parsed.cudagraph_capture_sizes == (1, 2)


@pytest.mark.parametrize("value, match", [
    ({"mode": "fast"}, "compilation_config.mode='fast'"),
    ({"mode": 7}, "compilation_config.mode=7"),
    ({"cudagraph_capture_sizes": [8, 4]}, "must be ascending"),
    ({"cudagraph_capture_sizes": [0, 4]}, "integers >= 1"),
    ({"backend": "xla"}, "compilation_config.backend='xla'"),
    ({"cudagraph_mode": "full"}, "compilation_config.cudagraph_mode='full'"),
    ({"fuse_norm_quant": "yes"}, "compilation_config.fuse_norm_quant='yes'"),
    ({"warp_speed": True}, "unknown field"),
    ("{not json", "not a JSON object"),
])
def test_bad_compilation_config_errors(value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompilationConfig.parse(value)


def test_capture_sizes_above_token_budget_rejected(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"above max_num_batched_tokens=32"):
        _engine(tiny_model_dir("llama"), {"cudagraph_capture_sizes": [8, 64]}, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="enforce_eager='no'"):
        _engine(tiny_model_dir("llama"), enforce_eager="no")


def test_inductor_compiled_equals_eager_and_second_engine_hits_cache(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("llama")
    prompts = _prompts(3, 3, 12, seed=5)
    expected = _generate(_engine(folder, enforce_eager=True), prompts)
    config = _compiled(tmp_path, backend="inductor", cudagraph_capture_sizes=[2, 4])
    first = _engine(folder, config)
    assert _forward(first).is_compiled and _forward(first).stats.num_cache_misses > 0
    assert _generate(first, prompts) == expected
    second = _engine(folder, config)
    stats = _forward(second).stats
    assert stats.num_cache_hits > 0 and stats.num_cache_misses == 0
    assert _generate(second, prompts) == expected
