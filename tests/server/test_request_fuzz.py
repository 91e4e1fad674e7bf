"""Every request field of /v1/completions and /v1/chat/completions, given a value of the wrong type and a value out
of range, gets a 4xx naming the field, and the server keeps serving: /health stays 200 and a request that needs
every admission slot still succeeds, so a rejected request never keeps a slot.

Also the two fuzzing finds that were 500s: a seed beyond 64 bits, and a body that is not valid UTF-8 (or holds an
unpaired surrogate escape).
"""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server_engine_settings import ENGINE_ARGS, MAX_MODEL_LEN
from server_process import ServerProcess

# Admission of 4 engine requests in all: the health check asks for n=4, so one slot kept by a rejected
# request makes it a 429. (No waiting: the 4 samples run in one batch, one token each.)
MAX_NUM_SEQS = 4
MAX_WAITING_REQUESTS = 0
HEALTH_CHECK_BODY = {"prompt": "still alive", "max_tokens": 1, "n": MAX_NUM_SEQS + MAX_WAITING_REQUESTS}

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = {"prompt": "hello", "max_tokens": 2}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BEYOND_64_BITS = 2 ** 70
NAN = float("nan")
INFINITY = float("inf")


def case(path: str, body: dict[str, Any] | bytes, status: int, needle: str, name: str) -> Any:
    """One row: POST `body` (a dict, sent as JSON with NaN/Infinity allowed, or raw bytes) to `path`; expect
    `status` and an error message containing `needle`."""
    return pytest.param(path, body, status, needle, id=name)


def completion(name: str, value: Any, status: int, needle: str | None = None) -> Any:
    return case(COMPLETIONS, {**PROMPT, name: value}, status, needle or name, f"completions-{name}={value!r:.40}")


def chat(name: str, value: Any, status: int, needle: str | None = None) -> Any:
    return case(CHAT, {**MESSAGES, name: value}, status, needle or name, f"chat-{name}={value!r:.40}")


def both(name: str, value: Any, status: int, needle: str | None = None) -> list[Any]:
    """The same field and value on both endpoints (the sampling fields they share)."""
    return [completion(name, value, status, needle), chat(name, value, status, needle)]


BAD_REQUESTS = [
    # ---- sampling fields both endpoints share: a wrong type (422), then values out of range (400)
    *both("model", 5, 422), *both("model", "no-such-model", 404, "no-such-model"),
    *both("n", "two", 422), *both("n", 0, 400, "n=0"), *both("n", BEYOND_64_BITS, 400, f"n={BEYOND_64_BITS}"),
    *both("n", 10 ** 6, 400, "1000000"),
    *both("best_of", "two", 422), *both("best_of", 3, 400, "best_of=3"),
    *both("temperature", "hot", 422), *both("temperature", -0.5, 400, "temperature=-0.5"),
    *both("temperature", NAN, 400, "temperature=nan"), *both("temperature", INFINITY, 400, "temperature=inf"),
    *both("top_p", "all", 422), *both("top_p", 1.5, 400, "top_p=1.5"), *both("top_p", 0, 400, "top_p=0"),
    *both("top_k", "ten", 422), *both("top_k", -2, 400, "top_k=-2"),
    *both("top_k", BEYOND_64_BITS, 400, f"top_k={BEYOND_64_BITS}"),
    *both("min_p", [], 422), *both("min_p", 1.5, 400, "min_p=1.5"),
    *both("presence_penalty", {}, 422), *both("presence_penalty", 2.5, 400, "presence_penalty=2.5"),
    *both("frequency_penalty", "x", 422), *both("frequency_penalty", -3, 400, "frequency_penalty=-3"),
    *both("repetition_penalty", "x", 422), *both("repetition_penalty", 0, 400, "repetition_penalty=0"),
    *both("repetition_penalty", INFINITY, 400, "repetition_penalty=inf"),
    *both("seed", "x", 422),
    *both("seed", BEYOND_64_BITS, 400, f"seed={BEYOND_64_BITS} must be in [-9223372036854775808, "
                                       "18446744073709551615]"),
    *both("seed", -BEYOND_64_BITS, 400, f"seed={-BEYOND_64_BITS} must be in [-9223372036854775808"),
    *both("stop", 5, 422), *both("stop", [""], 400, "stop=['']"),
    *both("stop_token_ids", ["x"], 422), *both("stop_token_ids", [-1], 400, "stop_token_ids"),
    *both("stop_token_ids", [10 ** 9], 400, "stop_token_ids contains 1000000000"),
    *both("ignore_eos", "maybe", 422),
    *both("min_tokens", "x", 422), *both("min_tokens", -1, 400, "min_tokens=-1"),
    *both("min_tokens", 3, 400, "min_tokens=3 must be <= max_tokens=2"),
    *both("skip_special_tokens", "maybe", 422), *both("include_stop_str_in_output", [1], 422),
    *both("stream", "maybe", 422),
    *both("stream_options", "yes", 422), *both("stream_options", {"include_usage": "maybe"}, 422,
                                              "stream_options.include_usage"),
    *both("stream_options", {"include_usage": True}, 400, "stream=true"),
    *both("logit_bias", "x", 422), *both("logit_bias", {"1": "up"}, 422, "logit_bias.1"),
    *both("logit_bias", {"1": 5}, 400, "logit_bias is not supported"),
    *both("user", 5, 422), *both("priority", "high", 422),
    *both("priority", BEYOND_64_BITS, 400, f"priority={BEYOND_64_BITS}"),
    *both("return_token_ids", "maybe", 422),
    *both("max_tokens", "many", 422), *both("max_tokens", 0, 400, "max_tokens=0"),
    *both("max_tokens", 5000, 400, str(MAX_MODEL_LEN)),
    # A bad value with stream=true is refused before the stream starts.
    case(COMPLETIONS, {**PROMPT, "stream": True, "temperature": -1}, 400, "temperature", "completions-stream-bad"),
    case(CHAT, {**MESSAGES, "stream": True, "top_p": 2}, 400, "top_p", "chat-stream-bad"),
    # ---- /v1/completions only
    case(COMPLETIONS, {"max_tokens": 2}, 422, "prompt", "completions-prompt-missing"),
    completion("prompt", 5, 422), completion("prompt", [1, "a"], 422), completion("prompt", "", 400, "empty"),
    completion("prompt", [], 400, "empty"), completion("prompt", [[]], 400, "empty"),
    completion("prompt", [10 ** 9], 400, "vocab"), completion("prompt", [BEYOND_64_BITS], 400, "vocab"),
    completion("prompt", "x " * (MAX_MODEL_LEN + 10), 400, str(MAX_MODEL_LEN)),
    completion("logprobs", "x", 422), completion("logprobs", -1, 400, "logprobs=-1"),
    completion("logprobs", 21, 400, "logprobs=21"),
    completion("echo", "maybe", 422),
    completion("suffix", 5, 422), completion("suffix", "tail", 400, "suffix is not supported"),
    # ---- /v1/chat/completions only
    case(CHAT, {"max_tokens": 2}, 422, "messages", "chat-messages-missing"),
    chat("messages", "hi", 422), chat("messages", [{"content": "no role"}], 422, "messages.0.role"),
    chat("messages", [{"role": 5, "content": "x"}], 422, "messages.0.role"),
    chat("messages", [], 400, "messages=[]"),
    chat("messages", [{"role": "user", "content": [{"type": "image_url"}]}], 400, "messages[0].content"),
    chat("max_completion_tokens", "x", 422), chat("max_completion_tokens", 0, 400, "max_completion_tokens=0"),
    chat("max_completion_tokens", 10 ** 6, 400, str(MAX_MODEL_LEN)),
    chat("logprobs", "maybe", 422),
    chat("top_logprobs", "x", 422), chat("top_logprobs", 3, 400, "needs logprobs=true"),
    case(CHAT, {**MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs=21", "chat-top_logprobs=21"),
    case(CHAT, {**MESSAGES, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs=-1", "chat-top_logprobs=-1"),
    chat("add_generation_prompt", "maybe", 422),
    chat("chat_template", 5, 422), chat("chat_template", "{% for %}", 400, "chat template"),
    chat("chat_template_kwargs", "x", 422), chat("chat_template_kwargs", {"messages": 1}, 400, "chat template"),
    chat("tools", "x", 422), chat("tools", [{"type": "function"}], 400, "tools[0].function is missing"),
    # ---- the fuzzing finds: a seed beyond what the sampler takes (also once n spreads it over seed .. seed+n-1)
    case(CHAT, {**MESSAGES, "n": 3, "seed": 2 ** 64 - 1}, 400, "seed=18446744073709551615 with n=3",
         "chat-seed-n3-overflows"),
    # ... and a body that is not valid UTF-8: ED A0 80 encodes a surrogate, which UTF-8 forbids
    case(COMPLETIONS, b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', 400, "prompt is not valid UTF-8: byte ED",
         "completions-prompt-utf8-surrogate-bytes"),
    case(CHAT, b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80"}], "max_tokens": 2}', 400,
         "messages[0].content is not valid UTF-8", "chat-content-utf8-surrogate-bytes"),
    case(COMPLETIONS, b'{"prompt": "\xff", "max_tokens": 2}', 400, "prompt is not valid UTF-8: byte FF",
         "completions-prompt-invalid-byte"),
    case(COMPLETIONS, b'\xff\xfe{\x00}\x00', 400, "the request body is not valid UTF-8", "completions-utf16-body"),
    # ... or that spells an unpaired surrogate as an escape: valid JSON, not valid Unicode text
    completion("prompt", "\ud800", 400, "prompt holds an unpaired UTF-16 surrogate"),
    completion("stop", ["ok", "\udfff"], 400, "stop[1] holds an unpaired"),
    completion("model", "\ud800", 400, "model holds an unpaired"),
    chat("messages", [{"role": "user", "content": "\udc00"}], 400, "messages[0].content holds an unpaired"),
    chat("messages", [{"role": "\ud800", "content": "x"}], 400, "messages[0].role holds an unpaired"),
    case("/tokenize", {"prompt": "\ud800"}, 400, "prompt holds an unpaired", "tokenize-prompt-surrogate"),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir("llama"), ENGINE_ARGS + [
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING_REQUESTS)])
    try:
        yield process
    finally:
        process.stop()


def post(server: ServerProcess, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    # json.dumps, not httpx's json=: it writes NaN and Infinity (which Python's parser reads) and escapes
    # lone surrogates as \udXXX.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=60)


def assert_still_serving(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    ok = post(server, COMPLETIONS, HEALTH_CHECK_BODY)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == HEALTH_CHECK_BODY["n"]


@pytest.mark.parametrize("path,body,status,needle", BAD_REQUESTS)
def test_bad_field_values_get_a_4xx_naming_the_field(server, path, body, status, needle):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"], error
    assert needle in error["message"], error
    assert_still_serving(server)


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {**PROMPT, "seed": 2 ** 64 - 1}),
    (COMPLETIONS, {**PROMPT, "seed": -(2 ** 63)}),
    (CHAT, {**MESSAGES, "n": 3, "seed": 2 ** 64 - 3}),
    (COMPLETIONS, {**PROMPT, "prompt": "caf\u00e9 \U0001f600"}),  # sent as a valid surrogate pair escape
], ids=["seed-max", "seed-min", "seed-max-n3", "surrogate-pair"])
def test_values_at_the_limits_are_served(server, path, body):
    """The seed limits are the sampler's own: the extreme seeds generate; a valid surrogate pair is text."""
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    assert_still_serving(server)
