"""LLMEngine.add_request is all or nothing: when the engine core refuses a request (for n > 1, any of its
children), neither the output processor nor the core keeps any part of it, and the engine serves on."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams


def test_a_refused_child_leaves_nothing_behind(tiny_model_dir, monkeypatch) -> None:
    llm = LLM(tiny_model_dir("llama"), max_model_len=64, num_kv_blocks=32)
    engine = llm.llm_engine
    core_add = engine.engine_core.add_request
    calls = []

    def refuse_the_second(request) -> None:
        calls.append(request.request_id)
        if len(calls) == 2:
            raise ValueError("refused by the test")
        core_add(request)

    monkeypatch.setattr(engine.engine_core, "add_request", refuse_the_second)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=0)
    with pytest.raises(ValueError, match="refused by the test"):
        engine.add_request("parent", {"prompt_token_ids": [5, 6, 7]}, params)
    assert len(calls) == 2
    assert not engine.output_processor.request_states and not engine.output_processor.parent_requests
    assert not engine.has_unfinished_requests()  # the first child was taken back out of the core
    monkeypatch.undo()
    engine.add_request("parent", {"prompt_token_ids": [5, 6, 7]}, params)  # the id is free again
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    assert [output.request_id for output in outputs] == ["parent"] and len(outputs[0].outputs) == 3
