"""DFlash and DSpark block drafting end to end on a tiny float32 llama with random drafters in their checkpoint
layouts: greedy output equals the same engine without speculation for K in {1, 3, 5}, with dynamic verify budgets
on and off, under chunked prefill and preemption, and at TP=2; every block of drafts equals a from-scratch
reference (target prefill capturing the layer outputs -> context KV -> one block forward -> argmax, or the Markov
walk for DSpark); the dynamic budget verifies fewer drafts; bad settings fail at start."""
from __future__ import annotations

import pytest
import torch

from drafter_checkpoints import write_dflash_checkpoint
from generation_helpers import GREEDY_36, generated_token_ids, seeded_tokens_alone_and_in_batch
from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.layers.block_draft_attention import BlockDraftMetadata
from pagedserve.worker.kv_cache_allocation import attention_layers
from paged_inputs import build_attention_metadata
from proposal_recorder import recorded_proposals

GREEDY = GREEDY_36  # the reference fixture's (conftest.py)
DYNAMIC = {"method": "dflash", "method_params": {"budget_update_interval": 2, "initial_verify_budget_per_req": 2}}


@pytest.fixture(scope="module")
def drafters(folder: str, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("block-drafters")
    return {
        "dflash": write_dflash_checkpoint(str(root / "dflash"), folder, seed=1),
        "dspark": write_dflash_checkpoint(str(root / "dspark"), folder, seed=2, dspark=True, draft_vocab_size=256),
        "dspark-rows": write_dflash_checkpoint(str(root / "dspark-rows"), folder, seed=3, dspark=True,
                                               sample_from_anchor=False),
    }


def _config(method: str, model: str, num_speculative_tokens: int, **extra: object) -> dict[str, object]:
    return {"method": method, "model": model, "num_speculative_tokens": num_speculative_tokens, **extra}


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.make_stats()


@pytest.mark.parametrize("drafter", ["dflash", "dspark", "dspark-rows"])
@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_output_equals_no_speculation(folder, drafters, prompts, reference, drafter,
                                             num_speculative_tokens) -> None:
    method = drafter.split("-")[0]
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256,
              speculative_config=_config(method, drafters[drafter], num_speculative_tokens))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    assert stats.spec_decode_num_drafts > 0
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("method, dynamic", [("dflash", DYNAMIC), ("dspark", dict(DYNAMIC, method="dspark"))])
def test_dynamic_verify_budgets_are_lossless_and_verify_fewer(folder, drafters, prompts, reference, method,
                                                              dynamic) -> None:
    k = 5
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256,
              speculative_config=_config(method, drafters[method], k, dynamic_spec_config=dynamic))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    # Random drafters are rejected: the budget falls to its floor, well below K drafts per verification.
    assert 0 < stats.spec_decode_num_draft_tokens < k * stats.spec_decode_num_drafts


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_lossless_under_preemption_and_chunked_prefill(folder, drafters, prompts, reference, method) -> None:
    llm = LLM(folder, max_model_len=96, num_kv_blocks=20, block_size=8, max_num_batched_tokens=16,
              speculative_config=_config(method, drafters[method], 3))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    assert _stats(llm).num_preemptions > 0, "the test must force preemptions"


def test_tensor_parallel_2(folder, drafters, prompts, reference) -> None:
    tp2 = LLM(folder, max_model_len=256, num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=_config("dspark", drafters["dspark"], 3, dynamic_spec_config=DYNAMIC))
    try:
        assert generated_token_ids(tp2, prompts, GREEDY) == reference
    finally:
        tp2.llm_engine.shutdown()


# ---- every block against a from-scratch reference ------------------------------------------------------------
@torch.no_grad()
def _reference_block(target, drafter, tokens: list[int], k: int) -> list[int]:
    block_size, n = 16, len(tokens)
    blocks = list(range(1, 1 + -(-(n + k) // block_size)))
    for module in (target, drafter):
        for layer in attention_layers(module):
            layer.kv_cache = torch.zeros(layer.kv_cache_spec().tensor_shape(64, block_size), dtype=torch.float32)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for index in drafter.aux_hidden_state_layer_ids:
        module = target.model.embed_tokens if index == -1 else target.model.layers[index]
        hooks.append(module.register_forward_hook(
            lambda _m, _a, out, i=index: captured.__setitem__(i, out if isinstance(out, torch.Tensor) else out[0] + out[1])))
    metadata, positions = build_attention_metadata([n], [0], [blocks], block_size)
    with set_forward_context(metadata):
        target(torch.tensor(tokens), positions)
    for hook in hooks:
        hook.remove()
    context = torch.cat([captured[i] for i in drafter.aux_hidden_state_layer_ids], dim=-1)[:n - 1]
    drafter.write_context(drafter.combine_hidden_states(context), positions[:n - 1], metadata.slot_mapping[:n - 1])
    from_anchor = hasattr(drafter, "markov_head") and drafter.sample_from_anchor
    num_rows = k if from_anchor else k + 1
    block_ids = torch.tensor([tokens[-1]] + [drafter.mask_token_id] * (num_rows - 1))
    block_metadata = BlockDraftMetadata.over(query_start_loc=[0, num_rows], context_lens=[n - 1],
                                             block_table=torch.tensor([blocks]), block_size=block_size)
    with set_forward_context(block_metadata):
        hidden, _ = drafter(block_ids, torch.arange(n - 1, n - 1 + num_rows))
    logits = drafter.compute_draft_logits(hidden[num_rows - k:])
    if not hasattr(drafter, "markov_head"):
        return drafter.map_draft_to_target(logits.argmax(dim=-1)).tolist()
    drafts, previous = [], tokens[-1]
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    for row in range(k):  # the Markov walk, one row at a time
        draft_id = int((logits[row] + w2 @ w1[previous]).argmax())
        previous = int(drafter.map_draft_to_target(torch.tensor(draft_id)))
        drafts.append(previous)
    return drafts


@pytest.mark.parametrize("drafter", ["dflash", "dspark", "dspark-rows"])
def test_blocks_equal_a_from_scratch_reference(folder, drafters, prompts, drafter) -> None:
    """Chunked prefill (16-token budget) writes the context over several steps, verification steps drop rejected
    positions; every proposed block must still be the one a clean pass over the verified tokens gives."""
    k = 3
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=16,
              speculative_config=_config(drafter.split("-")[0], drafters[drafter], k))
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    proposer = runner.speculator.hidden_state_proposer
    recorded = recorded_proposals(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                  min_num_drafts=k)
    assert len(recorded) >= 4
    for tokens, drafts in recorded:
        assert _reference_block(runner.model, proposer.drafter, tokens, k) == drafts, tokens


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    ({"dynamic_spec_config": {"method": "dspark"}}, "confidence head"),  # dflash drafter, dspark confidences
    ({"dynamic_spec_config": {"method": "other"}}, "dynamic_spec_config.method"),
    ({"dynamic_spec_config": {"method": "dflash", "method_params": {"budget_threshold": 2}}}, "budget_threshold"),
    ({"dynamic_spec_config": {"method": "dflash", "method_params": {"min_verify_tokens": 9}}}, "min_verify_tokens"),
    ({"dynamic_spec_config": {"method": "dflash"}, "num_speculative_tokens_per_batch_size": [[1, 4, 2]]},
     "set one of them"),
    ({"draft_sample_method": "probabilistic"}, "not supported with method 'dflash'"),
])
def test_bad_settings_fail_at_start(folder, drafters, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("dflash", drafters["dflash"], 3,
                                                                                     **extra))


def test_dspark_rules(folder, drafters, tmp_path) -> None:
    with pytest.raises(ValueError, match="DSpark drafts greedily only"):
        LLM(folder, max_model_len=256, num_kv_blocks=256,
            speculative_config=_config("dspark", drafters["dspark"], 3, draft_sample_method="probabilistic"))
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size is not supported"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config(
            "dspark", drafters["dspark"], 3, num_speculative_tokens_per_batch_size=[[1, 4, 2]]))
    headless = write_dflash_checkpoint(str(tmp_path / "headless"), folder, dspark=True, with_confidence_head=False)
    with pytest.raises(ValueError, match="confidence head"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config(
            "dspark", headless, 3, dynamic_spec_config={"method": "dspark"}))


def test_bad_target_layer_ids_are_named(folder, tmp_path) -> None:
    drafter = write_dflash_checkpoint(str(tmp_path / "layers"), folder, target_layer_ids=(0, 5))
    with pytest.raises(ValueError, match="target_layer_ids"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("dflash", drafter, 3))


def test_a_missing_tensor_is_named(folder, tmp_path) -> None:
    import os

    from safetensors.torch import load_file, save_file

    drafter = write_dflash_checkpoint(str(tmp_path / "broken"), folder, dspark=True)
    path = os.path.join(drafter, "model.safetensors")
    tensors = load_file(path)
    del tensors["markov_head.markov_w2.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"markov_head\.markov_w2\.weight"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("dspark", drafter, 3))


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(folder, drafters, prompts, method) -> None:
    """Block drafts are a function of the request's own tokens (greedy drafting, a fixed K), and the rejection
    sampler draws from the request's generator only."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config(method, drafters[method], 3))
    alone, in_batch = seeded_tokens_alone_and_in_batch(llm, prompts)
    assert alone == in_batch
