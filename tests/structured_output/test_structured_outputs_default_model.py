"""Structured outputs on the default model (SmolLM2-135M-Instruct): every output parses and validates.

The schema suite (schema_suite.py) covers nested objects, arrays with min/max items, enums, number ranges,
required/optional properties, anyOf and $ref; each runs greedy and sampled, and every output must be JSON that
validates against its schema (jsonschema, independent of the grammar engine). Regex and choice likewise.
"""
from __future__ import annotations

import json
import re

import jsonschema

from default_model_prompts import chat_prompt
from schema_suite import SCHEMA_SUITE

from pagedserve import SamplingParams
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

MAX_TOKENS = 128


def _params(constraint: StructuredOutputsParams, sampled: bool, **extra) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured_outputs=constraint, **extra)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint, **extra)


def test_every_schema_of_the_suite_validates_greedy_and_sampled(default_llm):
    names = list(SCHEMA_SUITE)
    prompts, params = [], []
    for name in names:
        # A short prompt (no schema in it): the grammar alone must make the output valid.
        question = f"Reply in JSON: an example of {name.replace('_', ' ')}."
        for sampled in (False, True):
            prompts.append(chat_prompt(default_llm, question))
            params.append(_params(StructuredOutputsParams(json=SCHEMA_SUITE[name]), sampled))
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    for index, output in enumerate(outputs):
        name, mode = names[index // 2], ("greedy", "sampled")[index % 2]
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, mode, completion.text)
        value = json.loads(completion.text)
        jsonschema.validate(value, SCHEMA_SUITE[name])
    # Every matcher was dropped with its finished request.
    assert default_llm.llm_engine.engine_core.scheduler.structured_output_manager._requests == {}


def test_json_object_regex_and_choice(default_llm):
    regex = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    choices = ["Paris", "London", "Berlin", "Madrid"]
    prompt = chat_prompt(default_llm, "What is the capital of France?")
    # json_object bounds nothing (a sampled string may run past max_tokens): greedy only.
    params = [_params(StructuredOutputsParams(json_object=True), False)]
    params += [_params(c, sampled) for c in (StructuredOutputsParams(regex=regex), StructuredOutputsParams(choice=choices))
               for sampled in (False, True)]
    outputs = default_llm.generate([prompt] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert isinstance(json.loads(texts[0]), dict), texts
    assert all(re.fullmatch(regex, text) for text in texts[1:3]), texts
    assert all(text in choices for text in texts[3:]), texts


def test_n2_stop_string_and_max_tokens(default_llm):
    prompt = chat_prompt(default_llm, "Give three colors.")
    schema = SCHEMA_SUITE["array_min_max_items"]
    # n = 2: each sample has its own matcher; both validate and differ only by sampling.
    (many,) = default_llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                            structured_outputs=StructuredOutputsParams(json=schema)),
                                   use_tqdm=False)
    assert len(many.outputs) == 2
    for completion in many.outputs:
        jsonschema.validate(json.loads(completion.text), schema)
    # max_tokens cuts the JSON: reported as 'length', the text is a prefix of the uncut greedy output.
    constraint = StructuredOutputsParams(json=schema)
    full, cut, stopped = default_llm.generate(
        [prompt] * 3, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint),
                       SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=constraint),
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[","],
                                      structured_outputs=constraint)], use_tqdm=False)
    assert full.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4
    assert full.outputs[0].text.startswith(cut.outputs[0].text)
    # A stop string ends a constrained request like any other (the text before it).
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == ","
    assert full.outputs[0].text.startswith(stopped.outputs[0].text)
    assert "," in full.outputs[0].text and "," not in stopped.outputs[0].text


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(default_llm):
    """The bitmask masks constrained rows only: unconstrained greedy requests batched with constrained ones (a JSON
    schema and a choice) give the same tokens as batched with unconstrained stand-ins of the same prompts and
    lengths. The reference keeps the batch's shape step by step and each run computes its prompts afresh: float32
    products are not batch invariant outside batch_invariant mode, and a prompt whose prefix comes from the cache is
    computed in other chunks, so either may part the answers at a near tie."""
    questions = ["Name a fruit.", "Count to five.", "Say hello."]
    prompts = [chat_prompt(default_llm, q) for q in questions]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    constrained = [_params(StructuredOutputsParams(json=SCHEMA_SUITE["enum"]), False),
                   _params(StructuredOutputsParams(choice=["yes", "no"]), False)]
    default_llm.reset_prefix_cache()
    mixed = default_llm.generate(prompts + prompts[:2], [plain] * 3 + constrained, use_tqdm=False)
    default_llm.reset_prefix_cache()
    stand_ins = [SamplingParams(temperature=0.0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
                 for o in mixed[3:]]
    reference = default_llm.generate(prompts + prompts[:2], [plain] * 3 + stand_ins, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in reference[3:]] == [len(o.outputs[0].token_ids) for o in mixed[3:]]
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in reference[:3]]
    assert all(o.outputs[0].finish_reason == "stop" for o in mixed[3:])
