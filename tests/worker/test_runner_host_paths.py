"""The model runner's host-side fast paths agree with plain references at every step of real generations.

- step inputs and attention metadata (vectorised, with an all-decode shortcut) vs a per-request,
  per-token Python loop over the persistent batch;
- the sampling metadata (reused between steps while the batch is unchanged and nothing in it depends
  on the step) vs build_sampling_metadata over every row's full token lists, built fresh;
- a request id used again after its request finished never sees the old request's cached metadata.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from generation_helpers import random_prompts

# Small token budget: prefill chunks share steps with decodes; a small cache adds preemptions.
ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 20, "max_num_batched_tokens": 48,
          "max_num_seqs": 8}


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _checked(check, failures: list[str]):
    """`check` with its assertion errors recorded: the engine turns a failing step into finish_reason
    'error' instead of raising, so the tests assert on the recorded failures at the end."""
    def run(*args):
        try:
            return check(*args)
        except AssertionError as error:
            failures.append(f"{check.__name__}: {error!r}")
            raise

    return run


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(output.outputs[0].finish_reason in ("length", "stop") for output in outputs)


def _reference_step(runner, scheduler_output) -> dict:
    """What the step's inputs must be, computed request by request and token by token."""
    batch = runner.input_batch
    block_size = runner.block_size
    num_scheduled = scheduler_output.num_scheduled_tokens
    request_ids = sorted(num_scheduled, key=lambda request_id: num_scheduled[request_id] != 1)
    input_ids, positions, slot_mapping, query_start_loc, seq_lens, is_sampled = [], [], [], [0], [], []
    for request_id in request_ids:
        row = batch.requests[request_id].row
        start = int(batch.num_computed_tokens[row])
        for position in range(start, start + num_scheduled[request_id]):
            input_ids.append(int(batch.token_ids[row, position]))
            positions.append(position)
            slot_mapping.append(int(batch.block_table[row, position // block_size]) * block_size
                                + position % block_size)
        query_start_loc.append(query_start_loc[-1] + num_scheduled[request_id])
        seq_lens.append(start + num_scheduled[request_id])
        is_sampled.append(start + num_scheduled[request_id] == int(batch.num_tokens[row]))
    num_decodes = 0
    while num_decodes < len(request_ids) and num_scheduled[request_ids[num_decodes]] == 1:
        num_decodes += 1
    return dict(request_ids=request_ids, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                query_start_loc=query_start_loc, seq_lens=seq_lens, is_sampled=is_sampled,
                num_decodes=num_decodes, max_query_len=max(num_scheduled.values()))


def test_step_inputs_and_attention_metadata_match_the_reference(folder: str, monkeypatch) -> None:
    llm = LLM(folder, **ENGINE)
    runner = _runner(llm)
    # All-greedy decode steps would read the batch natively (tests/models/test_native_decode_stack.py): this test is
    # about the Python path every other step takes, so all steps take it.
    runner.greedy_decode = None
    prepare_inputs, build_attention_metadata = runner._prepare_inputs, runner._build_attention_metadata
    expected_by_step: list[dict] = []
    kinds = {"all decodes": 0, "mixed": 0}

    def checking_prepare_inputs(scheduler_output):
        expected = _reference_step(runner, scheduler_output)
        step = prepare_inputs(scheduler_output)
        assert step.request_ids == expected["request_ids"]
        assert step.input_ids.tolist() == expected["input_ids"]
        assert step.positions.tolist() == expected["positions"] == step.positions_cpu.tolist()
        assert step.query_start_loc.tolist() == expected["query_start_loc"]
        assert step.is_sampled.tolist() == expected["is_sampled"]
        kinds["all decodes" if step.token_requests is None else "mixed"] += 1
        expected_by_step.append(expected)
        return step

    def checking_build_attention_metadata(step):
        expected = expected_by_step[-1]
        metadata = build_attention_metadata(step)
        assert metadata.slot_mapping.tolist() == expected["slot_mapping"]
        assert metadata.query_start_loc.tolist() == metadata.query_start_loc_cpu == expected["query_start_loc"]
        assert metadata.seq_lens.tolist() == metadata.seq_lens_cpu == expected["seq_lens"]
        assert metadata.num_actual_tokens == len(expected["input_ids"])
        assert metadata.num_decodes == metadata.num_decode_tokens == expected["num_decodes"]
        assert metadata.max_query_len == expected["max_query_len"]
        assert metadata.max_seq_len == max(expected["seq_lens"])
        batch = runner.input_batch
        for index, request_id in enumerate(expected["request_ids"]):
            row = batch.requests[request_id].row
            num_blocks = -(-expected["seq_lens"][index] // runner.block_size)
            assert metadata.block_table[index, :num_blocks].tolist() == batch.block_table[row, :num_blocks].tolist()
        return metadata

    failures: list[str] = []
    monkeypatch.setattr(runner, "_prepare_inputs", _checked(checking_prepare_inputs, failures))
    monkeypatch.setattr(runner, "_build_attention_metadata", _checked(checking_build_attention_metadata, failures))
    prompts = random_prompts(10, 3, 90, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(10)]
    _generate(llm, prompts, params)
    assert not failures, failures[:3]
    assert kinds["all decodes"] > 0 and kinds["mixed"] > 0, kinds
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0


def _assert_same_metadata(actual: SamplingMetadata, expected: SamplingMetadata) -> None:
    for name in SamplingMetadata.__dataclass_fields__:
        got, want = getattr(actual, name), getattr(expected, name)
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), name
            assert torch.equal(got, want), name
        elif name == "generators":
            assert got.keys() == want.keys() and all(got[row] is want[row] for row in want), name
        else:
            assert got == want, name


def test_sampling_metadata_equals_a_fresh_build_every_step(folder: str, monkeypatch) -> None:
    llm = LLM(folder, **ENGINE)
    runner = _runner(llm)
    sampling_metadata = runner._sampling_metadata
    returned: list[SamplingMetadata] = []

    def checking_sampling_metadata(states):
        metadata = sampling_metadata(states)
        batch = runner.input_batch
        expected = build_sampling_metadata(
            [s.sampling_params for s in states], [batch.prompt_token_ids(s) for s in states],
            [batch.output_token_ids(s) for s in states], [runner.generators.get(s.request_id) for s in states],
            runner.vocab_size, runner.device)
        _assert_same_metadata(metadata, expected)
        returned.append(metadata)
        return metadata

    failures: list[str] = []
    monkeypatch.setattr(runner, "_sampling_metadata", _checked(checking_sampling_metadata, failures))
    prompts = random_prompts(8, 3, 40, seed=12)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=25),
    ]
    # Step-independent requests only: the metadata is reused while the batch stays the same.
    _generate(llm, prompts, [kinds[i % 4] for i in range(8)])
    assert not failures, failures[:3]
    num_reused = sum(later is earlier for earlier, later in zip(returned, returned[1:]))
    assert num_reused > 10
    assert len({id(metadata) for metadata in returned}) > 3  # rebuilt as requests finish
    # With penalties or min_tokens pending the metadata depends on the step: never reused.
    returned.clear()
    with_state = [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.2),
                  SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10, ignore_eos=False)]
    _generate(llm, prompts[:4], [with_state[i % 2] for i in range(4)])
    assert not failures, failures[:3]
    assert all(later is not earlier for earlier, later in zip(returned, returned[1:]))


def test_a_request_id_used_again_gets_its_own_sampling(folder: str) -> None:
    """The sampling-metadata cache is keyed on the batch's version, not only on request ids."""
    prompt = {"prompt_token_ids": random_prompts(1, 20, 20, seed=13)[0]}
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    alone = LLM(folder, **ENGINE).generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids

    engine = LLM(folder, **ENGINE).llm_engine
    for params in (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), seeded):
        engine.add_request("same-id", prompt, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [output for output in engine.step() if output.finished]
    assert outputs[-1].outputs[0].token_ids == alone
