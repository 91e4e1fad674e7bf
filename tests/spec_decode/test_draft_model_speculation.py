"""draft_model speculative decoding end to end on tiny float32 llamas: lossless against the same engine without
speculation, a drafter equal to the target accepts every draft (greedy and sampled), a different drafter is
still lossless, under preemption and chunked prefill; the drafter's KV lives in the target's blocks."""
from __future__ import annotations

import pytest

from generation_helpers import GREEDY_36, generated_token_ids
from pagedserve import LLM, SamplingParams

GREEDY = GREEDY_36  # the reference fixture's (conftest.py)


@pytest.fixture(scope="module")
def other_drafter(tiny_model_dir) -> str:
    """Another random llama with the same tokenizer and vocabulary, one layer."""
    return tiny_model_dir("llama", seed=5, num_hidden_layers=1)


def _drafter(model: str, num_speculative_tokens: int) -> dict[str, object]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": num_speculative_tokens}


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.make_stats()


@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_target_as_its_own_drafter_accepts_everything(folder, prompts, reference, num_speculative_tokens) -> None:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_drafter(folder, num_speculative_tokens))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens  # acceptance 1.0
    per_position = stats.spec_decode_num_accepted_tokens_per_pos
    # Every verification accepts its first draft; later positions only lack drafts trimmed by max_tokens.
    assert len(per_position) == num_speculative_tokens and per_position[0] == stats.spec_decode_num_drafts


def test_catch_up_starts_after_the_accepted_drafts(folder, prompts, reference, monkeypatch) -> None:
    """The drafter's KV at the positions its accepted drafts went in at is kept: with the target as its own drafter
    (every draft accepted) each catch-up after a request's first runs over its last two tokens (the last draft,
    which never went in, and the bonus token), not over the K + 1 the verification emitted; and the output is
    still the reference."""
    from pagedserve.spec_decode.draft_model_proposer import DraftModelProposer

    catch_up_lengths: list[int] = []
    start = DraftModelProposer._start

    def recording_start(self, batch, state, known):  # type: ignore[no-untyped-def]
        first = start(self, batch, state, known)
        if first > 0:
            catch_up_lengths.append(known - first)
        return first

    monkeypatch.setattr(DraftModelProposer, "_start", recording_start)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_drafter(folder, 4))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert catch_up_lengths and max(catch_up_lengths) <= 2, catch_up_lengths


def test_sampled_drafts_from_the_target_itself_are_accepted(folder, prompts) -> None:
    """Sampled requests draw their drafts from the drafter's distribution (q) and verify against the target's (p):
    with the target as drafter p = q up to rounding, so every draft passes (u < p/q ~ 1)."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_drafter(folder, 4))
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=3)
    generated_token_ids(llm, prompts, params)
    stats = _stats(llm)
    assert stats.spec_decode_num_accepted_tokens >= 0.98 * stats.spec_decode_num_draft_tokens > 0


def test_another_drafter_is_lossless_and_rejects_some(folder, other_drafter, prompts, reference) -> None:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_drafter(other_drafter, 3))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    stats = _stats(llm)
    assert 0 <= stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_lossless_under_preemption_and_chunked_prefill(folder, other_drafter, prompts, reference) -> None:
    """A 16-token budget: prompts prefill in chunks, and the drafter catches up over them in forwards of at most 16
    tokens; few blocks force preemptions (the drafter starts over on the resumed request)."""
    llm = LLM(folder, max_model_len=96, num_kv_blocks=20, block_size=8, max_num_batched_tokens=16,
              speculative_config=_drafter(other_drafter, 3))
    assert generated_token_ids(llm, prompts, GREEDY) == reference
    assert _stats(llm).num_preemptions > 0, "the test must force preemptions"


def test_seeded_request_same_alone_and_batched(folder, other_drafter, prompts) -> None:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_drafter(other_drafter, 3))
    seeded = SamplingParams(temperature=0.8, top_k=30, max_tokens=24, ignore_eos=True, seed=77)
    alone = generated_token_ids(llm, prompts[:1], seeded)[0]
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded, others, others, others],
                           use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone


def test_drafter_kv_is_counted_in_the_blocks(folder) -> None:
    """The drafter's layers take KV in every block: with the target as drafter a block costs twice as much, so the
    same memory holds half the blocks."""
    memory = 4 << 20
    plain = LLM(folder, max_model_len=256, kv_cache_memory=memory)
    drafting = LLM(folder, max_model_len=256, kv_cache_memory=memory, speculative_config=_drafter(folder, 2))
    num_plain = plain.llm_engine.engine_core.runtime_info.num_kv_blocks
    assert drafting.llm_engine.engine_core.runtime_info.num_kv_blocks == num_plain // 2

def test_bad_drafter_is_a_clear_error(folder, tmp_path, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="needs speculative_config.model"):
        LLM(folder, max_model_len=256, num_kv_blocks=64,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    missing = str(tmp_path / "no-such-drafter")
    with pytest.raises(ValueError, match="speculative_config.model="):
        LLM(folder, max_model_len=256, num_kv_blocks=64, speculative_config=_drafter(missing, 2))
    other_vocab = tiny_model_dir("llama", vocab_size=384)
    with pytest.raises(ValueError, match="vocab_size=384"):
        LLM(folder, max_model_len=256, num_kv_blocks=64, speculative_config=_drafter(other_vocab, 2))
    short = tiny_model_dir("llama", max_position_embeddings=128)
    with pytest.raises(ValueError, match="handles 128 positions, fewer than max_model_len=256"):
        LLM(folder, max_model_len=256, num_kv_blocks=64, speculative_config=_drafter(short, 2))
