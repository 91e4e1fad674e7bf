"""A reasoning parser through the OpenAI server (default model, `--reasoning-parser deepseek_r1`), with the real
openai client: reasoning_content apart from content, streamed in its own deltas, and a response_format that
applies to the content after the reasoning.

SmolLM2 is no reasoning model, but it continues a few-shot pattern: the request's chat template renders the
examples (thinking between <think> and </think>, then a JSON answer) and opens <think> for the question, as a
DeepSeek-R1 template does.
"""
from __future__ import annotations

import json
import os
import sys

import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_process import ServerProcess  # noqa: E402

FEW_SHOT = ("Q: What is 1+1?\n<think>One plus one is two.</think>{\"answer\": 2}\n"
            "Q: What is 2+3?\n<think>Two plus three is five.</think>{\"answer\": 5}\n"
            "Q: What is 4+4?\n<think>Four plus four is eight.</think>{\"answer\": 8}\n")
TEMPLATE = "{% raw %}" + FEW_SHOT + "{% endraw %}" + \
    "{% for message in messages %}Q: {{ message['content'] }}\n{% endfor %}<think>"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    process = ServerProcess("smollm2-135m-instruct", ["--max-model-len", "1024", "--num-kv-blocks", "128",
                                                      "--reasoning-parser", "deepseek_r1"])
    try:
        yield openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        process.stop()


def _ask(client, stream: bool, **extra):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 3+3?"}], temperature=0, max_tokens=48,
        stream=stream, extra_body={"chat_template": TEMPLATE, **extra})


def test_reasoning_content_and_constrained_content_streamed_and_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    whole = _ask(client, False, response_format=response_format)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    # The grammar applied after </think>: the content is exactly one JSON answer, then the stop token.
    assert set(json.loads(message.content)) == {"answer"} and whole.choices[0].finish_reason == "stop"
    chunks = list(_ask(client, True, response_format=response_format))
    kinds, reasoning_parts, content_parts = [], [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta_reasoning = (choice.delta.model_extra or {}).get("reasoning_content")
            if delta_reasoning:
                reasoning_parts.append(delta_reasoning)
                kinds.append("reasoning")
            if choice.delta.content:
                content_parts.append(choice.delta.content)
                kinds.append("content")
    assert "".join(reasoning_parts) == reasoning and "".join(content_parts) == message.content
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # all reasoning deltas come first
    assert len(reasoning_parts) > 1  # streamed, not sent whole at the end


def test_without_a_constraint_the_content_is_what_follows_the_reasoning(client):
    whole = _ask(client, False)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    # Unconstrained, the model answers as in the examples and then runs on with the pattern until max_tokens.
    assert message.content.startswith('{"answer": ') and whole.choices[0].finish_reason == "length"
