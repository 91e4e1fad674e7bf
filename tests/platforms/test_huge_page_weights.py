"""The CPU's weights moved onto huge pages (platforms/huge_page_weights.py).

- The move itself: every large storage lands in one 2 MiB-aligned arena, bit for bit; every tensor viewing it keeps
  its offset, sizes and strides; tied weights stay one tensor; small storages and opaque tensors stay put.
- On/off equivalence through the engine: huge_page_weights=True and False give the same greedy tokens and bitwise
  logprobs over 40 steps (float32 and a tied bfloat16 model); with True the worker moved its weights once and the
  embedding lives in the arena, with False nothing moved; the CPU platform moves nothing where the kernel offers no
  huge pages to advise. The option's validation and CLI flag.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.config.cli_args import add_engine_args, load_engine_kwargs_from_args
from pagedserve.config.load import LoadConfig
from pagedserve.platforms import cpu as cpu_platform
from pagedserve.platforms.huge_page_memory import HUGE_PAGE_BYTES, transparent_huge_page_mode
from pagedserve.platforms.huge_page_weights import MIN_STORAGE_BYTES, HugePageWeights, move_weights_to_huge_pages
from process_mappings import smaps_field_of_mapping


def _vm_flags_of_mapping(address: int) -> list[str]:
    return smaps_field_of_mapping(address, "VmFlags")


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 48)  # 192000 bytes: moved
        self.head = nn.Linear(48, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter in two modules
        self.proj = nn.Linear(96, 512)  # weight 196608 bytes: moved; bias 2048 bytes: stays
        self.norm = nn.Parameter(torch.randn(48))  # small: stays
        self.register_buffer("table", torch.randn(300, 64))  # 76800 bytes: moved
        flat = torch.randn(40000)  # one storage behind two attribute views, like a fused weight's parts
        self.first_part = flat[:20000].view(100, 200)
        self.second_part = flat[20000:].view(200, 100).t()  # a strided view


def _snapshot(module: _Holder) -> dict[str, torch.Tensor]:
    return {"embed": module.embed.weight.detach().clone(), "proj": module.proj.weight.detach().clone(),
            "bias": module.proj.bias.detach().clone(), "norm": module.norm.detach().clone(),
            "table": module.table.clone(), "first": module.first_part.clone(),
            "second": module.second_part.clone()}


def _arena_range(arena: torch.Tensor) -> tuple[int, int]:
    return arena.data_ptr(), arena.data_ptr() + arena.numel()


def test_large_storages_move_bit_for_bit_and_views_keep_their_shape() -> None:
    torch.manual_seed(0)
    module = _Holder()
    before = _snapshot(module)
    small_addresses = (module.proj.bias.data_ptr(), module.norm.data_ptr())
    second_stride, second_offset = module.second_part.stride(), module.second_part.storage_offset()

    moved = move_weights_to_huge_pages(module)

    assert moved.arena is not None and moved.arena.data_ptr() % HUGE_PAGE_BYTES == 0
    # embed (= head), proj.weight, table, and the flat storage behind both parts.
    assert moved.num_storages == 4 and moved.num_tensors == 5
    start, end = _arena_range(moved.arena)
    for tensor in (module.embed.weight, module.proj.weight, module.table, module.first_part, module.second_part):
        assert start <= tensor.data_ptr() < end
        assert tensor.untyped_storage().data_ptr() == moved.arena.untyped_storage().data_ptr()
    assert (module.proj.bias.data_ptr(), module.norm.data_ptr()) == small_addresses
    # Storages start on their own 4 KiB page.
    assert all((t.data_ptr() - start) % 4096 == 0 for t in (module.embed.weight, module.proj.weight, module.table))
    # Tied weights stay one parameter; the two parts still share one copy, 20000 elements apart.
    assert module.head.weight is module.embed.weight
    assert module.second_part.data_ptr() - module.first_part.data_ptr() == 20000 * 4
    assert module.second_part.stride() == second_stride and module.second_part.storage_offset() != second_offset
    after = _snapshot(module)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    # The module still computes the same thing, and writes go to the new memory.
    ids = torch.tensor([[3, 999]])
    assert torch.equal(module.head(module.embed(ids)), before["embed"][ids] @ before["embed"].t())
    with torch.no_grad():
        module.embed.weight[0, 0] = 123.0
    assert module.head.weight[0, 0].item() == 123.0


def test_the_arena_is_advised_onto_huge_pages_where_the_kernel_has_them() -> None:
    module = nn.Linear(1024, 1024)
    moved = move_weights_to_huge_pages(module)
    assert moved.arena is not None
    if transparent_huge_page_mode() is None:  # no THP in this kernel: the advice is refused, small pages
        assert not moved.is_advised
    else:
        assert moved.is_advised and "hg" in _vm_flags_of_mapping(module.weight.data_ptr())


def test_nothing_to_move() -> None:
    module = nn.Linear(8, 8)
    assert module.weight.untyped_storage().nbytes() < MIN_STORAGE_BYTES
    address = module.weight.data_ptr()
    moved = move_weights_to_huge_pages(module)
    assert moved.arena is None and moved.num_storages == 0 and module.weight.data_ptr() == address


def test_opaque_tensors_stay() -> None:
    module = nn.Module()
    module.packed = torch.randn(512, 512).to_mkldnn()
    module.plain = nn.Parameter(torch.randn(512, 512))
    reference = module.packed.to_dense()
    moved = move_weights_to_huge_pages(module)
    assert moved.num_tensors == 1 and module.packed.is_mkldnn and torch.equal(module.packed.to_dense(), reference)


def _generate(folder: str, monkeypatch: pytest.MonkeyPatch,
              **options) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    moves: list[HugePageWeights] = []

    def recording_move(model: torch.nn.Module) -> HugePageWeights:
        moves.append(move_weights_to_huge_pages(model))
        return moves[-1]

    monkeypatch.setattr(cpu_platform, "move_weights_to_huge_pages", recording_move)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=64, **options)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    prompts = [[5, 17, 3, 99, 42], list(range(20, 60)), [7] * 12]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if options["huge_page_weights"] and transparent_huge_page_mode() in ("always", "madvise"):
        # The worker moved its weights once; the embedding (and with it the tied LM head) lives in the arena.
        assert len(moves) == 1 and moves[0].arena is not None
        embedding = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.embed_tokens.weight
        start, end = _arena_range(moves[0].arena)
        assert start <= embedding.data_ptr() < end
        assert "hg" in _vm_flags_of_mapping(embedding.data_ptr())
    else:
        assert not moves
    return [(o.outputs[0].token_ids,
             [sorted((token, entry.logprob) for token, entry in step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("kind,dtype", [("llama", "float32"), ("llama-tied", "bfloat16")])
def test_engine_outputs_equal_with_and_without(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, kind: str,
                                               dtype: str) -> None:
    folder = tiny_model_dir(kind)
    assert _generate(folder, monkeypatch, dtype=dtype, huge_page_weights=True) == \
        _generate(folder, monkeypatch, dtype=dtype, huge_page_weights=False)


@pytest.mark.parametrize("mode,moves", [("madvise", True), ("always", True), ("never", False), (None, False)])
def test_cpu_platform_moves_only_where_huge_pages_can_be_advised(monkeypatch: pytest.MonkeyPatch, mode: str | None,
                                                                 moves: bool) -> None:
    monkeypatch.setattr(cpu_platform, "transparent_huge_page_mode", lambda: mode)
    module = nn.Linear(1024, 1024)
    address = module.weight.data_ptr()
    cpu_platform.CpuPlatform().place_weights(module)
    assert (module.weight.data_ptr() != address) == moves


def test_option_validation_and_cli_flag() -> None:
    with pytest.raises(ValueError, match="huge_page_weights='yes' must be true or false"):
        LoadConfig(huge_page_weights="yes")  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert load_engine_kwargs_from_args(parser.parse_args([]))["huge_page_weights"] is True
    assert load_engine_kwargs_from_args(parser.parse_args(["--no-huge-page-weights"]))["huge_page_weights"] is False
