"""Sequence parallel over two gloo ranks: float32 greedy tokens equal to one process for the Llama
form, with chunked prefill and prompts whose token counts are odd (padded shards); token shards round-trip in one
process; unsupported combinations fail at start naming the knob."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config.engine import EngineConfig
from pagedserve.distributed.parallel_state import GroupCoordinator
from pagedserve.distributed.sequence_parallel import TokenShards

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=31, max_num_seqs=4,
              enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(8, 600) for _ in range(n)] for n in (5, 40, 23)]


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_sequence_parallel_equals_one_process(tiny_model_dir, kind: str) -> None:
    """(TP=2 without SP equals one process: tests/distributed/test_tensor_parallel.py.) Qwen3 (q/k norms in the
    gathered attention input) runs with `-m slow`."""
    folder = tiny_model_dir(kind)
    single = _generate(LLM(folder, **ENGINE))
    llm = LLM(folder, tensor_parallel_size=2, enable_sequence_parallel=True, **ENGINE)
    try:
        assert _generate(llm) == single
    finally:
        llm.llm_engine.shutdown()


def test_eagle_drafters_are_refused(tiny_model_dir, tmp_path) -> None:
    """EAGLE calls the target's embedding and reads its hidden states, which SP splits by token."""
    from spec_decode.drafter_checkpoints import write_eagle_checkpoint

    folder = tiny_model_dir("llama")
    drafter = write_eagle_checkpoint(str(tmp_path / "eagle"), folder)
    with pytest.raises(ValueError, match="speculative_config.method='eagle' reads the target's"):
        EngineConfig.create(folder, tensor_parallel_size=2, enable_sequence_parallel=True,
                            speculative_config={"method": "eagle", "model": drafter, "num_speculative_tokens": 2})


def test_hooks_take_over_the_row_parallel_reductions_and_keep_outputs(tiny_model_dir) -> None:
    """On a one-rank group the hooks are the identity: the same hidden states, with o_proj / down_proj no longer
    all-reducing themselves (the reduce-scatter hook does) and every hook in place."""
    from transformers import AutoConfig

    from pagedserve.attention.forward_context import set_forward_context
    from pagedserve.config.model import ModelConfig
    from pagedserve.distributed.sequence_parallel import apply_sequence_parallel
    from pagedserve.model_loader import load_model

    folder = tiny_model_dir("llama")
    model = load_model(ModelConfig(model=folder, dtype=torch.float32, hf_config=AutoConfig.from_pretrained(folder)),
                       "cpu")
    input_ids, positions = torch.tensor([5, 9, 13, 2, 7]), torch.arange(5)
    with torch.no_grad(), set_forward_context(None):
        expected = model(input_ids, positions)
        apply_sequence_parallel(model, GroupCoordinator(name="tp"))
        actual = model(input_ids, positions)
    torch.testing.assert_close(actual, expected)
    decoder = model.model
    assert decoder.embed_tokens._forward_hooks and decoder.norm._forward_hooks
    for layer in decoder.layers:
        assert layer.self_attn._forward_pre_hooks and layer.mlp._forward_pre_hooks
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert not linear.reduce_results and linear._forward_hooks


def test_token_shards_on_one_rank_round_trip() -> None:
    shards = TokenShards(GroupCoordinator(name="tp"))
    rows = torch.randn(7, 3)
    assert torch.equal(shards.scatter(rows), rows)
    assert torch.equal(shards.reduce_scatter(rows), rows)
    assert torch.equal(shards.gather(rows), rows)


@pytest.mark.parametrize("kind, kwargs, message", [
    ("llama", dict(enable_sequence_parallel=True), "tensor_parallel_size=1"),
    ("qwen3-moe", dict(tensor_parallel_size=2, enable_sequence_parallel=True), "enable_sequence_parallel=True supports"),
    ("llama", dict(tensor_parallel_size=2, enable_sequence_parallel=True, enforce_eager=False,
                   compilation_config={"mode": "compile"}), "runs eagerly"),
    ("llama", dict(tensor_parallel_size=2, enable_sequence_parallel=True, oproj_tensor_parallel_size=1),
     "oproj_tensor_parallel_size=1"),
])
def test_unsupported_combinations_fail_at_start(tiny_model_dir, kind: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_model_dir(kind), **kwargs)
