"""OutputProcessor: RequestOutputs from fabricated EngineCoreOutputs (text, stops, logprobs, n > 1)."""
from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from pagedserve.core.engine_core_output import EngineCoreOutput
from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import LogprobsLists
from pagedserve.engine.input_processor import InputProcessor, prompt_text_of
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind, logprobs_lists_to_dicts
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: str):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def input_processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=256)


@pytest.fixture
def output_processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


def add(input_processor: InputProcessor, output_processor: OutputProcessor, request_id: str, prompt: str | dict,
        params: SamplingParams, output_kind: str = "cumulative") -> list[Request]:
    requests = input_processor.process(request_id, prompt, params)
    output_processor.add_request(request_id, prompt_text_of(prompt), requests, params, output_kind=output_kind)
    return requests


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_tokens(output_processor: OutputProcessor, request_id: str, token_ids: list[int],
               finish_reason: str | None = "length", stop_reason: int | str | None = None) -> list[RequestOutput]:
    """Feed one token per step, finishing with the last; return every RequestOutput produced."""
    produced: list[RequestOutput] = []
    for position, token_id in enumerate(token_ids):
        is_last = position == len(token_ids) - 1
        output = EngineCoreOutput(request_id, [token_id], finish_reason=finish_reason if is_last else None,
                                  stop_reason=stop_reason if is_last else None)
        produced += output_processor.process_outputs([output]).request_outputs
    return produced


def test_cumulative_text_and_length_finish(input_processor, output_processor, tokenizer) -> None:
    add(input_processor, output_processor, "r", "Hi", SamplingParams(max_tokens=50))
    ids = encode(tokenizer, "Hello 世界 😀!")
    outputs = run_tokens(output_processor, "r", ids)
    assert len(outputs) == len(ids)
    texts = [output.outputs[0].text for output in outputs]
    assert all(texts[-1].startswith(text) for text in texts) and texts[-1] == "Hello 世界 😀!"
    assert all("\ufffd" not in text for text in texts)
    final = outputs[-1]
    assert final.finished and final.request_id == "r" and final.prompt == "Hi"
    assert final.prompt_token_ids == tokenizer.encode("Hi")
    completion = final.outputs[0]
    assert completion.token_ids == ids and completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.logprobs is None and completion.cumulative_logprob is None and final.prompt_logprobs is None
    assert not output_processor.has_unfinished_requests()
    assert outputs[0].outputs[0].token_ids is not outputs[1].outputs[0].token_ids  # snapshots, not shared lists


def test_delta_and_final_only_kinds(input_processor, output_processor, tokenizer) -> None:
    ids = encode(tokenizer, "Paris 東京 🚀 done")
    add(input_processor, output_processor, "d", "Hi", SamplingParams(), output_kind="delta")
    deltas = run_tokens(output_processor, "d", ids)
    assert "".join(output.outputs[0].text for output in deltas) == tokenizer.decode(ids)
    assert [t for output in deltas for t in output.outputs[0].token_ids] == ids
    assert all(len(output.outputs[0].token_ids) == 1 for output in deltas)
    add(input_processor, output_processor, "f", "Hi", SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
    finals = run_tokens(output_processor, "f", ids)
    assert len(finals) == 1 and finals[0].finished and finals[0].outputs[0].text == tokenizer.decode(ids)
    with pytest.raises(ValueError, match="output_kind='bogus'"):
        add(input_processor, output_processor, "x", "Hi", SamplingParams(), output_kind="bogus")


def test_stop_string_requests_abort(input_processor, output_processor, tokenizer) -> None:
    add(input_processor, output_processor, "s", "Hi", SamplingParams(stop=["STOP"]), output_kind="delta")
    ids = encode(tokenizer, "Hello world STOP here")
    shown = ""
    result = None
    for token_id in ids:
        result = output_processor.process_outputs([EngineCoreOutput("s", [token_id])])
        for output in result.request_outputs:
            shown += output.outputs[0].text
        if result.request_ids_to_abort:
            break
    assert result is not None and result.request_ids_to_abort == ["s"]
    final = result.request_outputs[0]
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert shown == "Hello world "
    # The engine may still report the request in the same step's race: it is ignored.
    late = output_processor.process_outputs([EngineCoreOutput("s", [5], finish_reason="stop")])
    assert late.request_outputs == [] and late.request_ids_to_abort == []


def test_stop_string_on_the_engine_finishing_step_needs_no_abort(input_processor, output_processor, tokenizer) -> None:
    add(input_processor, output_processor, "s", "Hi", SamplingParams(stop=["world"]))
    ids = encode(tokenizer, "Hello world")
    result = output_processor.process_outputs([EngineCoreOutput("s", ids, finish_reason="length")])
    assert result.request_ids_to_abort == []
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "Hello " and completion.finish_reason == "stop" and completion.stop_reason == "world"


def test_engine_stop_reasons(input_processor, output_processor, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    add(input_processor, output_processor, "e", "Hi", SamplingParams())
    (final,) = [o for o in run_tokens(output_processor, "e", encode(tokenizer, "Hello") + [eos], "stop") if o.finished]
    assert final.outputs[0].text == "Hello" and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason is None and final.outputs[0].token_ids[-1] == eos
    add(input_processor, output_processor, "t", "Hi", SamplingParams(stop_token_ids=[9]))
    outputs = run_tokens(output_processor, "t", encode(tokenizer, "Hello") + [9], "stop", stop_reason=9)
    assert outputs[-1].outputs[0].stop_reason == 9 and outputs[-1].outputs[0].text == "Hello"
    add(input_processor, output_processor, "a", "Hi", SamplingParams())
    result = output_processor.process_outputs([EngineCoreOutput("a", [], finish_reason="abort")])
    assert result.request_outputs[0].finished and result.request_outputs[0].outputs[0].finish_reason == "abort"


def test_logprobs_conversion(input_processor, output_processor, tokenizer) -> None:
    add(input_processor, output_processor, "l", "Hi", SamplingParams(logprobs=2))
    hello, world = encode(tokenizer, "Hello world")[:2]
    step_one = LogprobsLists([[hello, hello, 7]], [[-0.1, -0.1, -2.5]], [1])  # sampled is the top-1
    step_two = LogprobsLists([[world, 11, 12]], [[-3.0, -0.5, -1.0]], [4])  # sampled is outside the top-2
    output_processor.process_outputs([EngineCoreOutput("l", [hello], new_logprobs=step_one)])
    result = output_processor.process_outputs([EngineCoreOutput("l", [world], new_logprobs=step_two,
                                                                 finish_reason="length")])
    completion = result.request_outputs[0].outputs[0]
    first, second = completion.logprobs
    assert list(first) == [hello, 7]
    assert first[hello] == Logprob(-0.1, 1, tokenizer.decode([hello]))
    assert first[7] == Logprob(-2.5, 2, tokenizer.decode([7]))
    assert list(second) == [world, 11, 12]
    assert second[world] == Logprob(-3.0, 4, tokenizer.decode([world])) and second[11].rank == 1 and second[12].rank == 2
    assert math.isclose(completion.cumulative_logprob, -3.1)


def test_logprobs_zero_keeps_only_the_sampled_token(tokenizer) -> None:
    rows = LogprobsLists([[5, 6, 7]], [[-1.0, -0.2, -0.3]], [3])
    (entry,) = logprobs_lists_to_dicts(rows, 0, lambda token_id: tokenizer.decode([token_id]))
    assert entry == {5: Logprob(-1.0, 3, tokenizer.decode([5]))}


def test_delta_logprobs_are_per_step(input_processor, output_processor, tokenizer) -> None:
    add(input_processor, output_processor, "l", "Hi", SamplingParams(logprobs=1), output_kind="delta")
    for step, token_id in enumerate(encode(tokenizer, "Hello world")[:2]):
        rows = LogprobsLists([[token_id, token_id]], [[-1.0, -1.0]], [1])
        (output,) = output_processor.process_outputs(
            [EngineCoreOutput("l", [token_id], new_logprobs=rows)]).request_outputs
        assert len(output.outputs[0].logprobs) == 1 and output.outputs[0].cumulative_logprob == -(step + 1.0)


def test_prompt_logprobs_across_chunks(input_processor, output_processor, tokenizer) -> None:
    prompt_ids = tokenizer.encode("Hello world, this is")
    num_prompt = len(prompt_ids)
    add(input_processor, output_processor, "p", {"prompt_token_ids": prompt_ids}, SamplingParams(prompt_logprobs=1))
    # Position i predicts prompt token i+1: rows for positions 0..P-2, in two chunks.
    rows = [([prompt_ids[i + 1], 3], [-float(i + 1), -0.01], i + 2) for i in range(num_prompt - 1)]

    def chunk(part: list) -> LogprobsLists:
        return LogprobsLists([r[0] for r in part], [r[1] for r in part], [r[2] for r in part])

    split = 3
    first = output_processor.process_outputs([EngineCoreOutput("p", [], new_prompt_logprobs=chunk(rows[:split]))])
    assert first.request_outputs == []  # a partial prefill has nothing to show
    result = output_processor.process_outputs([EngineCoreOutput("p", [42], new_prompt_logprobs=chunk(rows[split:]),
                                                                finish_reason="length")])
    prompt_logprobs = result.request_outputs[0].prompt_logprobs
    assert len(prompt_logprobs) == num_prompt and prompt_logprobs[0] is None
    for position in range(1, num_prompt):
        entry = prompt_logprobs[position]
        actual = prompt_ids[position]
        assert entry[actual].logprob == -float(position) and entry[actual].rank == position + 1
        assert entry[3] == Logprob(-0.01, 1, tokenizer.decode([3]))


def test_parallel_sampling_fan_in(input_processor, output_processor, tokenizer) -> None:
    params = SamplingParams(n=3, seed=1, max_tokens=10, prompt_logprobs=0)
    children = add(input_processor, output_processor, "p", "Hi", params)
    assert output_processor.get_num_unfinished_requests() == 1
    texts = {0: "Hello", 1: "世界", 2: "😀 ok"}
    token_lists = {index: encode(tokenizer, text) for index, text in texts.items()}
    prompt_rows = LogprobsLists([[t, t] for t in children[0].prompt_token_ids[1:]],
                                [[-1.0, -1.0] for _ in children[0].prompt_token_ids[1:]],
                                [1 for _ in children[0].prompt_token_ids[1:]])
    last: RequestOutput | None = None
    num_steps = max(len(tokens) for tokens in token_lists.values())
    for step in range(num_steps):
        outputs = []
        for index in (2, 0, 1):  # engine order differs from index order
            tokens = token_lists[index]
            if step < len(tokens):
                outputs.append(EngineCoreOutput(
                    children[index].request_id, [tokens[step]],
                    new_prompt_logprobs=prompt_rows if (step == 0 and index == 0) else None,
                    finish_reason="length" if step == len(tokens) - 1 else None))
        result = output_processor.process_outputs(outputs)
        assert [output.request_id for output in result.request_outputs] == ["p"]
        last = result.request_outputs[0]
        assert [completion.index for completion in last.outputs] == [0, 1, 2]
        assert last.prompt_logprobs is not None and len(last.prompt_logprobs) == len(children[0].prompt_token_ids)
        assert last.finished == (step == num_steps - 1)
    assert last is not None
    assert [completion.text for completion in last.outputs] == [texts[0], texts[1], texts[2]]
    assert all(completion.finish_reason == "length" for completion in last.outputs)
    assert not output_processor.has_unfinished_requests()


def test_parallel_sampling_stop_string_in_one_child(input_processor, output_processor, tokenizer) -> None:
    children = add(input_processor, output_processor, "q", "Hi", SamplingParams(n=2, stop=["world"]),
                   output_kind="delta")
    ids = encode(tokenizer, "Hello world")
    result = output_processor.process_outputs([EngineCoreOutput(children[1].request_id, ids)])
    assert result.request_ids_to_abort == ["1_q"]
    (output,) = result.request_outputs
    assert not output.finished  # child 0 still runs
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in output.outputs] == [(1, "Hello ", "stop", "world")]
    result = output_processor.process_outputs([EngineCoreOutput(children[0].request_id, ids[:1], finish_reason="length")])
    (output,) = result.request_outputs
    assert output.finished and [c.index for c in output.outputs] == [0]


def test_abort_requests(input_processor, output_processor) -> None:
    add(input_processor, output_processor, "p", "Hi", SamplingParams(n=2))
    add(input_processor, output_processor, "s", "Hi", SamplingParams())
    assert output_processor.get_num_unfinished_requests() == 2
    assert output_processor.abort_requests(["p", "missing"]) == ["0_p", "1_p"]
    assert output_processor.get_num_unfinished_requests() == 1
    assert output_processor.process_outputs([EngineCoreOutput("0_p", [5])]).request_outputs == []
    assert output_processor.abort_requests(["s"]) == ["s"]
    assert not output_processor.has_unfinished_requests()


def test_add_request_validation(input_processor, output_processor) -> None:
    params = SamplingParams(n=2)
    requests = input_processor.process("p", "Hi", params)
    with pytest.raises(ValueError, match="requests has 1 entries but n=2"):
        output_processor.add_request("p", "Hi", requests[:1], params)
    output_processor.add_request("p", "Hi", requests, params)
    with pytest.raises(ValueError, match="already being processed"):
        output_processor.add_request("p", "Hi", requests, params)
