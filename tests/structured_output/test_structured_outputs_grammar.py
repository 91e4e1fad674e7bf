"""The grammar side of structured outputs, without a model: front-end validation, the bitmask against an
independently computed allowed-token list, xgrammar's mask kernel against the torch reference, and the
scheduler holding a request whose grammar is still compiling while the others step."""
from __future__ import annotations

import json
import threading

import pytest
import torch
import xgrammar

from schema_suite import SCHEMA_SUITE

from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import GrammarBitmask, ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.grammar_compiler import GrammarCompiler
from pagedserve.structured_output.grammar_validation import validate_structured_outputs
from pagedserve.structured_output.logits_mask import (allowed_token_mask, apply_grammar_bitmask,
                                                       apply_grammar_bitmask_reference, bitmask_words)
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer_and_stops():
    from pagedserve.model_loader.default_model import resolve_model_path
    from pagedserve.model_loader.model_source import open_model_source

    source = open_model_source(resolve_model_path(None))
    tokenizer = source.load_tokenizer(None)
    return tokenizer, sorted(source.eos_token_ids(tokenizer))


def make_compiler(tokenizer_and_stops, gate: threading.Event | None = None) -> GrammarCompiler:
    def load():
        if gate is not None:
            assert gate.wait(30)
        return tokenizer_and_stops
    return GrammarCompiler(load, vocab_size=len(tokenizer_and_stops[0]), cache_size=8)


# ---- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, needles", [
    (StructuredOutputsParams(json="{not json"), ["structured_outputs", "not valid JSON"]),
    (StructuredOutputsParams(json={"type": "strin"}), ["structured_outputs", "JSON schema", "strin"]),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     ["'not'", "#/properties/a", "not supported"]),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), ["'uniqueItems'", "#"]),
    (StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5}), ["'multipleOf'"]),
    (StructuredOutputsParams(regex="(abc"), ["regex", "parenthesis"]),
    (StructuredOutputsParams(regex="[a-"), ["regex", "position"]),
    (StructuredOutputsParams(grammar='root ::= "a" | b'), ["grammar", "b"]),
])
def test_bad_constraints_name_the_field_and_the_reason(params, needles):
    with pytest.raises(ValueError) as info:
        validate_structured_outputs(params, "structured_outputs")
    assert all(needle in str(info.value) for needle in needles), str(info.value)


def test_suite_schemas_regex_choice_and_grammar_validate():
    for schema in SCHEMA_SUITE.values():
        validate_structured_outputs(StructuredOutputsParams(json=schema))
    validate_structured_outputs(StructuredOutputsParams(regex=r"\d{3}-[a-z]+"))
    validate_structured_outputs(StructuredOutputsParams(choice=["a", 'quote"d', "back\\slash"]))
    validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    # A property *named* like an unsupported keyword is not that keyword.
    validate_structured_outputs(StructuredOutputsParams(json={"type": "object", "properties": {
        "not": {"type": "string"}}}))


@pytest.mark.parametrize("fields, needle", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"), ({"json": 5}, "json"), ({"regex": ""}, "regex"),
])
def test_structured_outputs_params_checks_its_fields(fields, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


# ---- the bitmask -------------------------------------------------------------------------------------
def allowed_by_accepting(matcher: xgrammar.GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """The allowed tokens found by trying each one (accept, then roll back): xgrammar's parser, not its
    precomputed token masks that fill_next_token_bitmask reads."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id in range(vocab_size):
        if matcher.accept_token(token_id):
            allowed[token_id] = True
            matcher.rollback(1)
    return allowed


def test_bitmask_equals_the_allowed_token_list_computed_by_accepting(tokenizer_and_stops):
    tokenizer, _ = tokenizer_and_stops
    vocab_size = len(tokenizer)
    compiler = make_compiler(tokenizer_and_stops)
    manager = StructuredOutputManager(compiler)
    cases = [(StructuredOutputsParams(json=SCHEMA_SUITE["enum"]), '{"size": "me'),
             (StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]+"), "12-"),
             (StructuredOutputsParams(choice=["apple", "apricot", "banana"]), "ap")]
    for index, (params, prefix) in enumerate(cases):
        request_id = f"r{index}"
        manager.add_request(request_id, params)
        manager._requests[request_id].future.result(timeout=60)
        assert manager.is_ready(request_id) and manager.error(request_id) is None
        for token_id in tokenizer.encode(prefix, add_special_tokens=False):
            assert manager.accept_token(request_id, token_id)
        bitmask = manager.grammar_bitmask([(request_id, [])])
        assert bitmask is not None and bitmask.first_row == {request_id: 0}
        engine_allowed = allowed_token_mask(bitmask_words(bitmask), vocab_size)[0]
        reference = allowed_by_accepting(manager._requests[request_id].matcher, vocab_size)
        assert 0 < int(reference.sum()) < vocab_size
        assert torch.equal(engine_allowed, reference), (params.kind, prefix)
        # The logits the sampler sees: exactly the allowed tokens stay finite.
        logits = torch.randn(2, vocab_size)
        apply_grammar_bitmask(logits, bitmask, ["other", request_id])
        assert torch.equal(torch.isfinite(logits[1]), reference) and torch.isfinite(logits[0]).all()
    manager.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xgrammar_mask_kernel_equals_the_torch_reference(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab_size, num_words = 1000, 32  # the words cover 1024 ids: the tail past the vocabulary is ignored
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, num_words), dtype=torch.int32, generator=generator)
    bitmask = GrammarBitmask(first_row={"a": 2, "c": 0}, num_rows=3, num_words=num_words,
                             bitmask=words.numpy().tobytes())
    logits = torch.randn(4, vocab_size, generator=generator).to(dtype)
    row_request_ids = ["a", "b", "c", "d"]
    kernel, reference = logits.clone(), logits.clone()
    apply_grammar_bitmask(kernel, bitmask, row_request_ids)
    apply_grammar_bitmask_reference(reference, bitmask, row_request_ids)
    assert torch.equal(kernel, reference)
    assert torch.equal(kernel[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched
    assert torch.isinf(kernel[0]).sum() == (~allowed_token_mask(words[2:3], vocab_size)).sum()


# ---- the scheduler waits for the compile ------------------------------------------------------------
def test_request_waits_for_its_grammar_while_others_step(tokenizer_and_stops):
    tokenizer, stop_ids = tokenizer_and_stops
    gate = threading.Event()
    manager = StructuredOutputManager(make_compiler(tokenizer_and_stops, gate))
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                          KVCacheManager(32, 4, True), 4, structured_output_manager=manager)
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    scheduler.add_request(Request("constrained", [5, 6, 7], SamplingParams(
        max_tokens=8, structured_outputs=constraint, all_stop_token_ids=set(stop_ids)), eos_token_id=stop_ids[0]))
    scheduler.add_request(Request("plain", [8, 9], SamplingParams(max_tokens=8)))
    for _ in range(3):  # compiling: the plain request steps, the constrained one waits in the queue
        output = scheduler.schedule()
        assert list(output.num_scheduled_tokens) == ["plain"] and output.grammar_bitmask is None
        scheduler.update_from_output(output, ModelRunnerOutput(request_ids=["plain"], sampled_token_ids=[[11]]))
        assert scheduler.requests["constrained"].status == RequestStatus.WAITING
    gate.set()
    manager._requests["constrained"].future.result(timeout=60)
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"plain", "constrained"}
    assert output.grammar_bitmask is not None and list(output.grammar_bitmask.first_row) == ["constrained"]
    allowed = allowed_token_mask(bitmask_words(output.grammar_bitmask), len(tokenizer))[0]
    allowed_texts = {tokenizer.decode([token_id]) for token_id in allowed.nonzero().flatten().tolist()}
    assert allowed_texts and all(text and ("yes".startswith(text) or "no".startswith(text)) for text in allowed_texts)
    assert {"yes", "no"} <= allowed_texts or {"y", "n"} <= allowed_texts
    # An allowed token advances the matcher; a token the grammar forbids finishes the request with an error.
    first = tokenizer.encode("no", add_special_tokens=False)
    scheduler.update_from_output(output, ModelRunnerOutput(request_ids=["plain", "constrained"],
                                                           sampled_token_ids=[[11], [first[0]]]))
    assert scheduler.requests["constrained"].output_token_ids == [first[0]]
    output = scheduler.schedule()
    bad_token = tokenizer.encode("x", add_special_tokens=False)[0]
    outputs = scheduler.update_from_output(output, ModelRunnerOutput(request_ids=["plain", "constrained"],
                                                                     sampled_token_ids=[[11], [bad_token]]))
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished == {"constrained": "error"} and "constrained" not in manager._requests
    manager.shutdown()


def test_a_grammar_that_fails_to_compile_finishes_only_its_request(tokenizer_and_stops):
    manager = StructuredOutputManager(make_compiler(tokenizer_and_stops))
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                          KVCacheManager(32, 4, True), 4, structured_output_manager=manager)
    # Not validated (the front end would refuse it): the compile fails on the compile thread.
    bad = StructuredOutputsParams(json=json.dumps({"type": "strin"}))
    scheduler.add_request(Request("bad", [5, 6], SamplingParams(max_tokens=4, structured_outputs=bad)))
    scheduler.add_request(Request("plain", [8, 9], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError):
        manager._requests["bad"].future.result(timeout=60)
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["plain"]
    outputs = scheduler.update_from_output(output, ModelRunnerOutput(request_ids=["plain"], sampled_token_ids=[[3]]))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finish_reason == "error" and "could not be compiled" in by_id["bad"].stop_reason
    assert by_id["plain"].new_token_ids == [3] and "bad" not in scheduler.requests
    manager.shutdown()


def test_with_a_reasoning_parser_the_grammar_applies_after_the_end_tag(tokenizer_and_stops):
    from pagedserve.reasoning.reasoning_parser import get_reasoning_parser

    tokenizer, _ = tokenizer_and_stops
    manager = StructuredOutputManager(make_compiler(tokenizer_and_stops), reasoning_parser=get_reasoning_parser(
        "deepseek_r1"))
    choice = StructuredOutputsParams(choice=["yes", "no"])
    manager.add_request("thinking", choice, tokenizer.encode("Question?", add_special_tokens=False))
    closed_prompt = tokenizer.encode("Question?<think>ok</think>", add_special_tokens=False)
    manager.add_request("closed", choice, closed_prompt)
    for request_id in ("thinking", "closed"):
        if manager._requests[request_id].future is not None:
            manager._requests[request_id].future.result(timeout=60)
        assert manager.is_ready(request_id)
    # The prompt closed the reasoning of "closed": constrained at once; "thinking" is free while it reasons.
    bitmask = manager.grammar_bitmask([("thinking", []), ("closed", [])])
    assert bitmask is not None and list(bitmask.first_row) == ["closed"]
    for token_id in tokenizer.encode("Let me see: x </think", add_special_tokens=False):
        assert manager.accept_token("thinking", token_id)  # anything goes while reasoning
        assert manager.is_reasoning("thinking")
    for token_id in tokenizer.encode(">", add_special_tokens=False):
        assert manager.accept_token("thinking", token_id)
    assert not manager.is_reasoning("thinking")
    bitmask = manager.grammar_bitmask([("thinking", [])])
    assert bitmask is not None and list(bitmask.first_row) == ["thinking"]
    allowed = allowed_token_mask(bitmask_words(bitmask), len(tokenizer))[0]
    assert not allowed[tokenizer.encode("x", add_special_tokens=False)[0]]
    manager.shutdown()


def test_each_distinct_constraint_compiles_once(tokenizer_and_stops):
    compiler = make_compiler(tokenizer_and_stops)
    manager = StructuredOutputManager(compiler)
    schema = SCHEMA_SUITE["ref"]
    for index in range(3):  # the first compiles on the compile thread; the others find it cached
        manager.add_request(f"same{index}", StructuredOutputsParams(json=schema))
        future = manager._requests[f"same{index}"].future
        if future is not None:
            future.result(timeout=60)
        assert manager.is_ready(f"same{index}")
    manager.add_request("other", StructuredOutputsParams(regex="[ab]+"))
    manager._requests["other"].future.result(timeout=60)
    assert (compiler.num_compiles, compiler.num_cache_hits) == (2, 2)
    for request_id in ("same0", "same1", "same2", "other"):
        manager.free(request_id)
    assert manager._requests == {}
    manager.shutdown()


def test_without_xgrammar_structured_outputs_are_refused_by_name(monkeypatch):
    import importlib.util

    from pagedserve.engine.input_processor import InputProcessor
    from pagedserve.structured_output.grammar_validation import structured_outputs_refusal

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "xgrammar" else real_find_spec(name, *args))
    reason = structured_outputs_refusal(object())  # the engine config is not read before the install check
    assert reason is not None and "pip install --no-deps xgrammar" in reason
    processor = InputProcessor(object(), vocab_size=100, max_model_len=64, structured_outputs_refusal=reason)
    with pytest.raises(ValueError, match="structured_outputs is not supported by this engine: the grammar engine"):
        processor.resolve_params(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), 4)
