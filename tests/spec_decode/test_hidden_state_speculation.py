"""EAGLE, EAGLE-3 and MTP speculative decoding end to end on tiny float32 targets with random drafters written in
their published checkpoint layouts: greedy output equals the same engine without speculation (which
tests/e2e/test_hf_parity.py holds to HF transformers) for K in {1, 3, 5}, under chunked prefill and preemption;
every draft the engine proposes equals a from-scratch reference (target prefill -> drafter prefill over the shifted
tokens -> autoregressive drafts, on a fresh KV cache); clear errors for broken checkpoints and bad settings."""
from __future__ import annotations


import pytest
import torch

from drafter_checkpoints import add_mtp_layers, edit_config, write_eagle3_checkpoint, write_eagle_checkpoint
from generation_helpers import GREEDY_36, generated_token_ids, seeded_tokens_alone_and_in_batch
from paged_inputs import build_attention_metadata
from proposal_recorder import recorded_proposals
from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.worker.kv_cache_allocation import attention_layers

GREEDY = GREEDY_36  # the reference fixture's (conftest.py)


@pytest.fixture(scope="module")
def drafters(folder: str, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafters")
    return {
        "eagle": write_eagle_checkpoint(str(root / "eagle"), folder, seed=1),
        "eagle3": write_eagle3_checkpoint(str(root / "eagle3"), folder, seed=2, draft_vocab_size=256),
    }


def _config(method: str, model: str | None, num_speculative_tokens: int) -> dict[str, object]:
    config: dict[str, object] = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if model is not None:
        config["model"] = model
    return config


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.make_stats()


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_output_equals_no_speculation(folder, drafters, prompts, reference, method,
                                             num_speculative_tokens) -> None:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256,
              speculative_config=_config(method, drafters[method], num_speculative_tokens))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) <= num_speculative_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_lossless_under_preemption_and_chunked_prefill(folder, drafters, prompts, reference, method) -> None:
    """A 16-token budget: prompts prefill in chunks (the drafter runs over each chunk with the target); few blocks
    force preemptions (a resumed request is recomputed, and its drafter KV with it)."""
    llm = LLM(folder, max_model_len=96, num_kv_blocks=20, block_size=8, max_num_batched_tokens=16,
              speculative_config=_config(method, drafters[method], 3))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    assert _stats(llm).num_preemptions > 0, "the test must force preemptions"


def test_sampled_requests_run_and_stay_seeded(folder, drafters, prompts) -> None:
    """Sampled requests verify greedy drafts against their own distribution; a seed repeats its output."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle", drafters["eagle"], 3))
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=7)
    first = generated_token_ids(llm, prompts[:2], params)
    assert generated_token_ids(llm, prompts[:2], params) == first
    assert all(len(tokens) == 24 for tokens in first)


# ---- the drafts themselves against a from-scratch reference ---------------------------------------------------
def _fresh_caches(module: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    for layer in attention_layers(module):
        layer.kv_cache = torch.zeros(layer.kv_cache_spec().tensor_shape(num_blocks, block_size), dtype=torch.float32)


def _forward(module, call, num_new: int, num_computed: int, block_size: int):  # type: ignore[no-untyped-def]
    blocks = list(range(1, 1 + -(-(num_computed + num_new) // block_size)))
    metadata, positions = build_attention_metadata([num_new], [num_computed], [blocks], block_size)
    with set_forward_context(metadata):
        return call(positions)


@torch.no_grad()
def _reference_drafts(target, drafter, capture_ids, tokens: list[int], num_drafts: int) -> list[int]:
    """Target prefill over `tokens`, drafter prefill over positions 0..n-2 (token p + 1, hidden p), then drafts."""
    block_size, n = 16, len(tokens)
    _fresh_caches(target, 64, block_size)
    _fresh_caches(drafter, 64, block_size)
    ids = torch.tensor(tokens)
    captured: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[i].register_forward_pre_hook(
        lambda module, args, i=i: captured.__setitem__(i, args[1] if args[2] is None else args[1] + args[2]))
        for i in set(capture_ids)]
    hidden = _forward(target, lambda positions: target(ids, positions), n, 0, block_size)
    for hook in hooks:
        hook.remove()
    if capture_ids:
        hidden = torch.cat([captured[i] for i in capture_ids], dim=-1)
    hidden = drafter.combine_hidden_states(hidden[:n - 1])
    out, next_hidden = _forward(drafter, lambda positions: drafter(ids[1:], positions, hidden, 0), n - 1, 0,
                                block_size)
    drafts = [int(drafter.compute_logits(out[-1:], 0).argmax())]
    state = next_hidden[-1:]
    for j in range(1, num_drafts):
        token = torch.tensor([drafts[-1]])
        out, state = _forward(drafter, lambda positions: drafter(token, positions, state, j), 1, n - 2 + j,
                              block_size)
        drafts.append(int(drafter.compute_logits(out, j).argmax()))
    return drafts


def _check_drafts_against_reference(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    """Every proposal made while generating (the request's tokens so far, its drafts), recomputed from
    scratch with the engine's own target and drafter. Returns how many proposals were checked."""
    runner = _runner(llm)
    recorded = recorded_proposals(llm, prompts, params)
    drafter = runner.speculator.hidden_state_proposer.drafter
    capture_ids = list(drafter.aux_hidden_state_layer_ids)
    for tokens, drafts in recorded:
        assert _reference_drafts(runner.model, drafter, capture_ids, tokens, len(drafts)) == drafts, tokens
    return len(recorded)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_a_from_scratch_reference(folder, drafters, prompts, method) -> None:
    """Chunked prefill (16-token budget) and verification steps that reject drafts: the drafter's KV and inputs
    must still be those of one clean pass over the verified tokens."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=16,
              speculative_config=_config(method, drafters[method], 3))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert _check_drafts_against_reference(llm, prompts[:2], params) >= 4


# ---- MTP: the target's own multi-token-prediction layers -----------------------------------------------------
@pytest.fixture(scope="module", params=["deepseek-v3", "glm4-moe"])
def mtp_target(request, tiny_model_dir, tmp_path_factory) -> str:
    import shutil

    folder = str(tmp_path_factory.mktemp(f"mtp-{request.param}") / "model")
    shutil.copytree(tiny_model_dir(request.param), folder)
    return add_mtp_layers(folder, seed=3)


@pytest.mark.parametrize("num_speculative_tokens", [1, 3])
def test_mtp_greedy_output_equals_no_speculation(mtp_target, prompts, num_speculative_tokens) -> None:
    reference = generated_token_ids(LLM(mtp_target, max_model_len=256, num_kv_blocks=256), prompts[:2], GREEDY)
    llm = LLM(mtp_target, max_model_len=256, num_kv_blocks=256,
              speculative_config=_config("mtp", None, num_speculative_tokens))
    assert generated_token_ids(llm, prompts[:2], GREEDY) == reference
    assert _stats(llm).spec_decode_num_drafts > 0


def test_mtp_drafts_equal_a_from_scratch_reference(mtp_target, prompts) -> None:
    llm = LLM(mtp_target, max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=16,
              speculative_config=_config("mtp", None, 2))
    assert _check_drafts_against_reference(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8,
                                                                            ignore_eos=True)) >= 2


# ---- loading and bad input -----------------------------------------------------------------------------------
def test_original_eagle_release_format_loads(folder, tmp_path, prompts, reference) -> None:
    """pytorch_model.bin without fc.bias (both seen in EAGLE releases)."""
    drafter = write_eagle_checkpoint(str(tmp_path / "eagle-bin"), folder, seed=4, as_bin=True, fc_bias=False)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle", drafter, 2))
    assert generated_token_ids(llm, prompts[:1], GREEDY) == reference[:1]


def test_a_missing_tensor_is_named(folder, tmp_path) -> None:
    drafter = write_eagle3_checkpoint(str(tmp_path / "broken"), folder, drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(ValueError, match=r"layers\.0\.hidden_norm\.weight"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle3", drafter, 2))


def test_a_wrong_shape_is_named(folder, tmp_path) -> None:
    drafter = write_eagle_checkpoint(str(tmp_path / "wide"), folder)
    edit_config(drafter, intermediate_size=256)  # the checkpoint's MLP is 128 wide
    with pytest.raises(ValueError, match="gate_up_proj|down_proj"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle", drafter, 2))


def test_bad_eagle3_layer_ids_are_named(folder, tmp_path) -> None:
    drafter = write_eagle3_checkpoint(str(tmp_path / "layers"), folder, aux_layer_ids=(0, 1, 7))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle3", drafter, 2))


def test_mtp_missing_tensor_is_named(tiny_model_dir, tmp_path) -> None:
    import shutil

    target = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("deepseek-v3"), target)
    add_mtp_layers(target, drop=("eh_proj.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.eh_proj\.weight"):
        LLM(target, max_model_len=256, num_kv_blocks=256, speculative_config=_config("mtp", None, 1))


@pytest.mark.parametrize("speculative_config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs speculative_config.model"),
    ({"method": "eagle", "model": "/no/such/folder", "num_speculative_tokens": 2}, "no config.json"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "multi-token-prediction layers"),
])
def test_bad_settings_fail_at_start(folder, speculative_config, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=speculative_config)


def test_a_drafter_for_another_hidden_size_is_rejected(folder, tmp_path) -> None:
    drafter = write_eagle_checkpoint(str(tmp_path / "other"), folder)
    edit_config(drafter, hidden_size=2 * 64)  # the target's hidden states are 64 wide
    with pytest.raises(ValueError, match="hidden states of size"):
        LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config("eagle", drafter, 2))


# eagle3 over TP=2 is slow-marked: eagle covers the drafter's TP path; eagle3's own parts are tested in one process.
@pytest.mark.parametrize("method", ["eagle", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_tensor_parallel_2_equals_one_process(folder, drafters, prompts, reference, method) -> None:
    """TP=2 over the 'mp' executor: the drafter's layers are split like the target's (its fc replicated)."""
    tp2 = LLM(folder, max_model_len=256, num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=_config(method, drafters[method], 3))
    try:
        assert generated_token_ids(tp2, prompts, GREEDY) == reference
        seeded = SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=20, ignore_eos=True)
        one = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config(method, drafters[method], 3))
        assert generated_token_ids(tp2, prompts, seeded) == generated_token_ids(one, prompts, seeded)
    finally:
        tp2.llm_engine.shutdown()


def test_mtp_tensor_parallel_2(mtp_target, prompts) -> None:
    reference = generated_token_ids(LLM(mtp_target, max_model_len=256, num_kv_blocks=256), prompts[:2], GREEDY)
    tp2 = LLM(mtp_target, max_model_len=256, num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=_config("mtp", None, 2))
    try:
        assert generated_token_ids(tp2, prompts[:2], GREEDY) == reference
    finally:
        tp2.llm_engine.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(folder, drafters, prompts, method) -> None:
    """Greedy drafts are a function of the request's own tokens (a fixed K), and the rejection sampler draws from
    the request's generator only."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_config(method, drafters[method], 3))
    alone, in_batch = seeded_tokens_alone_and_in_batch(llm, prompts)
    assert alone == in_batch
