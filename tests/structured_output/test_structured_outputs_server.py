"""Structured outputs through the OpenAI server on the default model, with the real openai client:
response_format (json_schema, json_object) on chat and completions, vLLM's structured_outputs field, streamed
and not; bad constraints are a 400 naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import os
import re
import sys

import jsonschema
import openai
import pytest

from schema_suite import SCHEMA_SUITE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_process import ServerProcess  # noqa: E402

SCHEMA = SCHEMA_SUITE["nested_objects"]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("smollm2-135m-instruct", ["--max-model-len", "1024", "--num-kv-blocks", "256"])
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_response_format_json_schema_streamed_and_not(client, model):
    messages = [{"role": "user", "content": "Who lives where? Answer in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=128,
                                           response_format=response_format)
    content = whole.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=128,
                                            response_format=response_format, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == content


def test_completions_json_object_regex_and_choice(client, model):
    prompt = "The capital of France is"
    as_json = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=64,
                                        extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(as_json.choices[0].text), dict)
    regex = r" [A-Z][a-z]+\."
    by_regex = client.completions.create(model=model, prompt=prompt, temperature=0.8, seed=1, max_tokens=16,
                                         extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, by_regex.choices[0].text), by_regex.choices[0].text
    choices = [" Paris", " Lyon", " Nice"]
    by_choice = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": choices}})
    assert by_choice.choices[0].message.content in choices


@pytest.mark.parametrize("extra_body, needles", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     ["response_format.json_schema.schema", "strin"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, ["response_format.json_schema.schema", "uniqueItems"]),
    ({"structured_outputs": {"regex": "(ab"}}, ["structured_outputs.regex", "parenthesis"]),
    ({"structured_outputs": {"json": "{not json"}}, ["structured_outputs.json", "not valid JSON"]),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, ["structured_outputs.grammar"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, ["exactly one"]),
])
def test_bad_constraints_are_400_naming_the_field_and_the_server_keeps_serving(client, model, extra_body, needles):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=extra_body)
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert all(needle in message for needle in needles), message
    ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
