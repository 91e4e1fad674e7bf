"""Test helper: every proposal a hidden-state or block drafter makes while an LLM generates, with the tokens the
request had then, for checking the drafts against a from-scratch reference."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams


def recorded_proposals(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                       min_num_drafts: int = 1) -> list[tuple[list[int], list[int]]]:
    """(the request's known tokens, its drafts) for each proposal of at least `min_num_drafts` drafts."""
    proposer = llm.llm_engine.engine_core.executor.worker.model_runner.speculator.hidden_state_proposer
    recorded: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording_propose(batch, target, sampled_token_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        drafts = propose(batch, target, sampled_token_ids, *args, **kwargs)
        for request_id, request_drafts in zip(target.step.request_ids, drafts):
            if len(request_drafts) >= min_num_drafts:
                row = batch.requests[request_id].row
                recorded.append((batch.token_ids[row, :int(batch.num_tokens[row])].tolist(), request_drafts))
        return drafts

    proposer.propose = recording_propose
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        proposer.propose = propose
    return recorded
