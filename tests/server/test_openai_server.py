"""The OpenAI-compatible server end to end: a real `pagedserve serve` process, the real openai client.

One server (with an API key) serves the whole module; the last test stops it with SIGTERM and checks
that no child process is left.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest

from server_engine_settings import ENGINE_ARGS, ENGINE_KWARGS, MAX_MODEL_LEN
from server_process import ServerProcess, child_pids, pid_exists

API_KEY = "sk-pagedserve-test"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir("llama"), ENGINE_ARGS + ["--max-body-bytes", "65536"], api_key=API_KEY)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def model_name(tiny_model_dir) -> str:
    return tiny_model_dir("llama").rstrip("/")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    from pagedserve.llm import LLM

    return LLM(tiny_model_dir("llama"), **ENGINE_KWARGS)


def metrics_values(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


# ---------------------------------------------------------------------------------------- basics
def test_models_health_version(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    version = httpx.get(f"{server.base_url}/version").json()
    assert version["version"]


def test_completion_non_streaming(client, model_name):
    completion = client.completions.create(model=model_name, prompt="hello world", max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == model_name
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7


def test_greedy_matches_llm_generate(client, model_name, reference_llm):
    from pagedserve.sampling_params import SamplingParams

    prompts = ["hello world", "def fibonacci(n):", "The quick brown fox"]
    expected = reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, reference in zip(prompts, expected):
        completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"return_token_ids": True})
        choice = completion.choices[0]
        assert choice.token_ids == reference.outputs[0].token_ids
        assert choice.text == reference.outputs[0].text
        assert choice.finish_reason == reference.outputs[0].finish_reason

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]
    chat_reference = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == chat_reference.outputs[0].token_ids
    assert chat.choices[0].message.content == chat_reference.outputs[0].text
    assert chat.usage.prompt_tokens == len(chat_reference.prompt_token_ids)


def test_completion_streaming_equals_non_streaming(client, model_name):
    full = client.completions.create(model=model_name, prompt="stream me", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model_name, prompt="stream me", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_prompt_shapes_and_echo(server, client, model_name):
    ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                     json={"prompt": "echo this"}).json()["tokens"]
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0, echo=True)
    by_text = client.completions.create(model=model_name, prompt="echo this", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text.endswith(by_text.choices[0].text)
    assert by_ids.choices[0].text.startswith("echo this")
    batch = client.completions.create(model=model_name, prompt=["echo this", "hello world"], max_tokens=5,
                                      temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both samples of a prompt agree
    assert batch.usage.completion_tokens == 4 * 5
    single = client.completions.create(model=model_name, prompt="hello world", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert batch.usage.prompt_tokens == by_text.usage.prompt_tokens + single.usage.prompt_tokens


def test_chat_non_streaming_and_streaming(client, model_name):
    messages = [{"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                          temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert 1 <= full.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_seeded_sampling(client, model_name):
    completion = client.completions.create(model=model_name, prompt="sample", max_tokens=8, temperature=1.0,
                                           n=2, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens == 16
    again = client.completions.create(model=model_name, prompt="sample", max_tokens=8, temperature=1.0,
                                      n=2, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]
    chat_chunks = list(client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=6, n=2, seed=3, stream=True))
    choices = [choice for chunk in chat_chunks for choice in chunk.choices]  # a chunk may carry both choices
    roles = [choice.index for choice in choices if choice.delta.role == "assistant"]
    assert roles == [0, 1]  # both role chunks come before any content
    assert all(choice.delta.role is None for choice in choices[2:])
    finished = sorted(choice.index for choice in choices if choice.finish_reason)
    assert finished == [0, 1]


def test_logprobs(client, model_name):
    completion = client.completions.create(model=model_name, prompt="logprobs", max_tokens=6, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-5)
    echoed = client.completions.create(model=model_name, prompt="logprobs", max_tokens=2, temperature=0,
                                       logprobs=1, echo=True)
    echoed_logprobs = echoed.choices[0].logprobs
    assert echoed_logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert len(echoed_logprobs.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens

    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string(client, model_name):
    base = client.completions.create(model=model_name, prompt="def fibonacci(n):", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    candidates = [text[i:i + 2] for i in range(3, len(text) - 2)
                  if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]]
    assert candidates, f"no usable stop string in {text!r}"
    stop = candidates[0]
    stopped = client.completions.create(model=model_name, prompt="def fibonacci(n):", max_tokens=20,
                                        temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.index(stop)]
    assert choice.stop_reason == stop
    streamed = list(client.completions.create(model=model_name, prompt="def fibonacci(n):", max_tokens=20,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_tokenize_detokenize(server):
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                        json={"prompt": "round trip"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.base_url}/detokenize", headers=server.headers,
                      json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "round trip" in text
    chat_tokens = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                             json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tokens["count"] > 1


def test_32_concurrent_streaming_clients(server, model_name):
    async def run() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as async_client:
            async def one(index: int) -> tuple[str, int, str]:
                stream = await async_client.completions.create(
                    model=model_name, prompt=f"client number {index}", max_tokens=12, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                text, usage, finish = "", 0, ""
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                return text, usage, finish

            return await asyncio.gather(*(one(index) for index in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    assert all(usage == 12 and finish == "length" for _, usage, finish in results)
    assert metrics_values(server)["vllm:num_requests_running"] == 0


def _wait_for_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics_values(server)
        if values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"the request was not freed: {values}")
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(server, model_name):
    aborted_before = metrics_values(server).get("vllm:request_success_total", 0)
    # Sampled with the most logprobs a request may ask (20, each one detokenized), so the steps take the general path
    # and the stream's output is slow to make: the 2000 tokens take far longer than the three events and the metrics
    # read below (with 5 logprobs, ~1.1 s on a 2-core VM, a loaded run once finished first; greedy decode of the tiny
    # model from the persistent batch writes them in ~0.4 s).
    body = {"model": model_name, "prompt": "a long story", "max_tokens": 2000, "temperature": 1.0, "seed": 0,
            "logprobs": 20, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", headers=server.headers, json=body) as response:
            assert response.status_code == 200
            # Pull lines by hand: leaving a `for` over iter_lines() would close the response early.
            lines = response.iter_lines()
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            busy = metrics_values(server)
            assert busy["vllm:num_requests_running"] == 1
            assert busy["vllm:kv_cache_usage_perc"] > 0
        # Leaving the block closes the connection mid-stream.
    _wait_for_idle(server)
    assert metrics_values(server)["vllm:request_success_total"] == aborted_before + 1  # counted as 'abort'

    # Non-streaming: the client gives up (timeout) before the answer; the server aborts the request (sampled with
    # logprobs as above: greedy decode would write the 2000 tokens within the client's timeout).
    body.update(stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, json=body, timeout=0.5)
    _wait_for_idle(server)


BAD_REQUESTS = [
    # (path, body or raw bytes, status, text the message must contain)
    ("/v1/completions", {"prompt": "x " * (MAX_MODEL_LEN + 10), "max_tokens": 4}, 400, str(MAX_MODEL_LEN)),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 5000}, 400, "5000"),
    ("/v1/completions", {"prompt": "hello", "model": "no-such-model"}, 404, "no-such-model"),
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": "many"}, 422, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/completions", {"prompt": "hello", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hello", "n": 0}, 400, "n=0"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hello", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "vocab"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, "65536"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, 400,
     str(MAX_MODEL_LEN)),
    ("/v1/chat/completions", {"messages": "hi"}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ("/detokenize", {"tokens": [-1]}, 400, "-1"),
    ("/tokenize", {}, 400, "prompt"),
    ("/v1/no-such-endpoint", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD_REQUESTS,
                         ids=[f"{p}-{s}-{i}" for i, (p, _, s, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, path, body, status, needle):
    kwargs = {"content": body, "headers": {**server.headers, "content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body, "headers": server.headers}
    response = httpx.post(f"{server.base_url}{path}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and needle in error["message"], error
    # The server keeps serving.
    ok = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers,
                    json={"prompt": "still alive", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_max_model_len_message_names_both_numbers(client, model_name):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="hello", max_tokens=5000)
    message = caught.value.body["message"] if isinstance(caught.value.body, dict) else str(caught.value)
    assert "5000" in message and str(MAX_MODEL_LEN) in message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="unknown", prompt="hello")


def test_api_key_is_enforced(server, model_name):
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").status_code == 200
    bad_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=model_name, prompt="hi", max_tokens=2)


def test_metrics_have_vllm_names(server):
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", 'vllm:request_success_total{finished_reason="length"'):
        assert name in text, name
    values = metrics_values(server)
    assert values["vllm:generation_tokens_total"] > 0 and values["vllm:prompt_tokens_total"] > 0
    assert values["vllm:prefix_cache_queries_total"] > 0


def test_bench_serve_against_server(server, model_name, tmp_path):
    from pagedserve.cli import main

    result_file = tmp_path / "bench.json"
    status = main(["bench", "serve", "--base-url", server.base_url, "--model", model_name, "--api-key", API_KEY,
                   "--num-prompts", "6", "--input-len-range", "8", "24", "--output-len-range", "4", "8",
                   "--request-rate", "50", "--seed", "1", "--vocab-range", "10", "600",
                   "--goodput", "ttft:60000", "tpot:60000",
                   "--result-file", str(result_file)])
    assert status == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert 6 * 4 <= result["total_output_tokens"] <= 6 * 8
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = result[metric]
        assert 0 < stats["p50"] <= stats["p99"]
    assert result["goodput_requests_per_s"] == pytest.approx(result["request_throughput"])


def test_sigterm_leaves_no_child_process(server):
    """Runs last: SIGTERM with a stream in flight; the server exits 0 and its engine process is gone."""
    engine_pid = server.engine_pid
    assert engine_pid is not None and pid_exists(engine_pid)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", headers=server.headers,
                         json={"prompt": "in flight", "max_tokens": 30, "ignore_eos": True,
                               "stream": True}) as response:
            server.process.send_signal(15)
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"  # the in-flight request finished within the grace period
    assert server.process.wait(timeout=30) == 0
    assert not pid_exists(engine_pid)
    assert child_pids(server.process.pid) == []
    assert os.path.exists(server.log.name)
