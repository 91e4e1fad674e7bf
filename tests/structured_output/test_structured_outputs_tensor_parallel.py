"""Structured outputs with tensor parallelism (2 ranks, gloo, the tiny random llama with its own tokenizer): the
bitmask travels with the step to every rank, and the constrained greedy outputs equal those of one rank."""
from __future__ import annotations

import json
import re

from pagedserve import LLM, SamplingParams
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)
REGEX = r"[a-z]{2,6}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["s", "m", "l"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["size", "n"], "additionalProperties": False}


def _constrained(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=12)]
    outputs = llm.generate(["the cat", "a dog and", "one two"], params, use_tqdm=False)
    assert re.fullmatch(REGEX, outputs[0].outputs[0].text), outputs[0].outputs[0].text
    assert set(json.loads(outputs[1].outputs[0].text)) == {"size", "n"}
    return [o.outputs[0].token_ids for o in outputs]


def test_tp2_constrained_outputs_equal_one_rank(tiny_model_dir):
    folder = tiny_model_dir("llama")
    single = LLM(folder, **ENGINE)
    try:
        reference = _constrained(single)
    finally:
        single.llm_engine.shutdown()
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    try:
        assert _constrained(llm) == reference
    finally:
        llm.llm_engine.shutdown()
