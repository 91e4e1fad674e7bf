"""`pagedserve proxy --kv-transfer-mode push` end to end: real P and D servers (PullConnector in push mode), the
proxy, the real openai client; and the servers' caller-chosen request ids that the push mode rests on.

One set of processes serves the module: P (kv_producer, push; started with --enable-request-id-headers) and D
(kv_consumer, push, kv_load_failure_policy 'fail': a request whose layers did not come from P fails, so a right
answer proves the push), and a push-mode proxy over them. P answers requests without kv_transfer_params as an
ordinary engine: they are the one-engine reference. The last test kills P, so it runs last.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))

from server_process import ServerProcess  # noqa: E402
from test_pd_proxy import (ENGINE_ARGS, ProxyProcess, kv_cache_usage, start_servers,  # noqa: E402
                           wait_until_every_block_is_free)

FREE_TIMEOUT_S = 8
PUSH_PRODUCER = {"kv_connector": "PullConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"mode": "push", "free_timeout_s": FREE_TIMEOUT_S}}
PUSH_CONSUMER = {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                 "kv_connector_extra_config": {"mode": "push", "transfer_timeout_s": 5}}
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and runs far away",
           "one two three four five six seven eight nine ten eleven twelve"]
MESSAGES = [{"role": "user", "content": "tell me a story about a fox"}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    model = tiny_model_dir("llama")
    launches = [ENGINE_ARGS + ["--kv-transfer-config", json.dumps(PUSH_PRODUCER), "--enable-request-id-headers"],
                ENGINE_ARGS + ["--kv-transfer-config", json.dumps(PUSH_CONSUMER)]]
    servers: list[ServerProcess] = []
    proxy = None
    try:
        servers = start_servers(model, launches)
        prefill, decode = servers
        # A long health interval: the last test's request, not the probe, finds P dead.
        proxy = ProxyProcess([prefill.base_url], [decode.base_url],
                             ("--kv-transfer-mode", "push", "--health-interval", "60"))
        yield {"prefill": prefill, "decode": decode, "proxy": proxy, "model": model.rstrip("/")}
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop(timeout=3)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster['proxy'].base_url}/v1", api_key="none", max_retries=0, timeout=60)


def one_engine(cluster, endpoint: str, body: dict) -> dict:
    """P alone, as an ordinary engine (no kv_transfer_params): the reference answer."""
    response = httpx.post(f"{cluster['prefill'].base_url}{endpoint}", timeout=60,
                          json={"model": cluster["model"], "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True} | body)
    assert response.status_code == 200, response.text
    return response.json()


def test_push_through_the_proxy_equals_one_engine(cluster, client):
    """Completions and chat, whole and streamed: D's greedy answer equals one engine's (D fails a request whose
    layers P did not push, so this is the push at work); every block on P and D ends free."""
    for prompt in PROMPTS[:2]:
        completion = client.completions.create(model=cluster["model"], prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        reference = one_engine(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 12})
        assert completion.choices[0].token_ids == reference["choices"][0]["token_ids"]
        assert completion.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=cluster["model"], prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    reference = one_engine(cluster, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 10})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["choices"][0]["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one piece
    assert chunks[-1].usage.completion_tokens == 10
    chat = client.chat.completions.with_raw_response.create(model=cluster["model"], messages=MESSAGES,
                                                            max_tokens=8, temperature=0,
                                                            extra_body={"ignore_eos": True})
    reference = one_engine(cluster, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8})
    assert chat.parse().choices[0].message.content == reference["choices"][0]["message"]["content"]
    # The proxy's request id: its answer's header, and the id D ran the request under.
    request_id = chat.headers["x-request-id"]
    assert len(request_id) == 32 and chat.parse().id == f"chatcmpl-{request_id}"
    traced = client.chat.completions.with_raw_response.create(model=cluster["model"], messages=MESSAGES,
                                                              max_tokens=8, temperature=0,
                                                              extra_headers={"X-Request-Id": "trace-push"},
                                                              extra_body={"ignore_eos": True})
    assert traced.headers["x-request-id"] == "trace-push" and traced.parse().id == "chatcmpl-trace-push"
    assert traced.parse().choices[0].message.content == reference["choices"][0]["message"]["content"]
    streamed = client.chat.completions.create(model=cluster["model"], messages=MESSAGES, max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == reference["choices"][0]["message"]["content"]
    wait_until_every_block_is_free([cluster["prefill"], cluster["decode"]])


def test_concurrent_requests_keep_to_their_own_kv(cluster):
    """Requests through the proxy at the same time (each its own id on P and D) get each their own prompt's
    answer."""
    prompts = [f"{prompt} {index}" for index, prompt in enumerate(PROMPTS * 2)]
    expected = [one_engine(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 6})["choices"][0]["token_ids"]
                for prompt in prompts]

    def through_proxy(prompt: str) -> list[int]:
        response = httpx.post(f"{cluster['proxy'].base_url}/v1/completions", timeout=60, json={
            "model": cluster["model"], "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(through_proxy, prompts)) == expected
    wait_until_every_block_is_free([cluster["prefill"], cluster["decode"]])


def test_servers_take_caller_chosen_request_ids(cluster):
    """vLLM's conventions: the X-Request-Id header, else the body's request_id, names the request (chatcmpl-<id>,
    cmpl-<id>); --enable-request-id-headers echoes it; an id still running is a 400 naming request_id."""
    base = cluster["prefill"].base_url
    body = {"model": cluster["model"], "prompt": PROMPTS[0], "max_tokens": 2}
    by_header = httpx.post(f"{base}/v1/chat/completions", headers={"X-Request-Id": "trace-1"}, timeout=60, json={
        "model": cluster["model"], "messages": MESSAGES, "max_tokens": 2})
    assert by_header.json()["id"] == "chatcmpl-trace-1" and by_header.headers["x-request-id"] == "trace-1"
    by_body = httpx.post(f"{base}/v1/completions", json=body | {"request_id": "mine-2"}, timeout=60)
    assert by_body.json()["id"] == "cmpl-mine-2"
    assert len(by_body.headers["x-request-id"]) == 32  # no header given: a random one is echoed
    both = httpx.post(f"{base}/v1/completions", json=body | {"request_id": "body"}, headers={"X-Request-Id": "hdr"},
                      timeout=60)
    assert both.json()["id"] == "cmpl-hdr"
    empty = httpx.post(f"{base}/v1/completions", json=body | {"request_id": ""}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "request_id"

    # Still running for sure: a D request waiting for layers that never come (P never gets its request).
    decode = cluster["decode"].base_url
    info = httpx.get(f"{base}/kv_transfer_info", timeout=10).json()
    waiting = body | {"request_id": "busy", "stream": True, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": info["engine_id"], "remote_host": info["host"],
        "remote_port": info["ports"][0], "remote_block_ids": [], "remote_request_id": "nobody"}}
    with httpx.stream("POST", f"{decode}/v1/completions", json=waiting, timeout=60) as running:
        assert running.status_code == 200
        duplicate = httpx.post(f"{decode}/v1/completions", json=body | {"request_id": "busy"}, timeout=60)
        assert duplicate.status_code == 400, duplicate.text
        error = duplicate.json()["error"]
        assert error["param"] == "request_id" and "'busy' is already used by a request still running" in \
            error["message"]
        chat = httpx.post(f"{decode}/v1/chat/completions", headers={"X-Request-Id": "busy"}, timeout=60, json={
            "model": cluster["model"], "messages": MESSAGES, "max_tokens": 2})
        assert chat.status_code == 200  # chatcmpl-busy is another request than cmpl-busy
    # The client left: D aborted the request, and the id is free again.
    deadline = time.monotonic() + 10
    while (again := httpx.post(f"{decode}/v1/completions", json=body | {"request_id": "busy"}, timeout=60)) \
            .status_code != 200:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.1)
    wait_until_every_block_is_free([cluster["decode"]])


def test_an_id_whose_blocks_p_holds_is_refused_not_mixed(cluster):
    """P's finished do_remote_decode request holds its blocks under its id until a consumer takes them: a new
    request under that id fails alone (finish_reason 'error', the engine keeps serving), and D, sent the held
    request's id afterwards, still gets that request's KV (P computed it before D asked) and P frees it."""
    prefill, decode = cluster["prefill"].base_url, cluster["decode"].base_url
    prompt = PROMPTS[1]
    held = {"model": cluster["model"], "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True}}
    assert httpx.post(f"{prefill}/v1/completions", json=held, headers={"X-Request-Id": "held"},
                      timeout=60).status_code == 200
    assert kv_cache_usage(cluster["prefill"]) > 0  # held for a consumer
    collision = httpx.post(f"{prefill}/v1/completions", headers={"X-Request-Id": "held"}, timeout=60,
                           json={"model": cluster["model"], "prompt": PROMPTS[0], "max_tokens": 4})
    assert collision.status_code == 200, collision.text
    assert collision.json()["choices"][0]["finish_reason"] == "error"
    assert collision.json()["choices"][0]["text"] == ""
    info = httpx.get(f"{prefill}/kv_transfer_info", timeout=10).json()
    assert info["kv_role"] == "kv_producer" and info["mode"] == "push" and info["ports"][0] > 0
    decoded = httpx.post(f"{decode}/v1/completions", timeout=60, json={
        "model": cluster["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": info["engine_id"], "remote_host": info["host"],
            "remote_port": info["ports"][0], "remote_block_ids": [], "remote_request_id": "cmpl-held-0"}})
    assert decoded.status_code == 200, decoded.text
    reference = one_engine(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 8})
    assert decoded.json()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    wait_until_every_block_is_free([cluster["prefill"], cluster["decode"]])


def test_a_client_that_leaves_releases_p_and_d(cluster):
    """A client that closes its stream mid-answer, or gives up on a whole answer: P and D end with every block
    free and the proxy with nothing in flight."""
    url = f"{cluster['proxy'].base_url}/v1/completions"
    # As long an answer as the context allows: the whole answer must outlast the client's patience (0.3 s) however
    # fast the engine decodes.
    body = {"model": cluster["model"], "prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_until_every_block_is_free([cluster["prefill"], cluster["decode"]])
    metrics = httpx.get(f"{cluster['proxy'].base_url}/metrics", timeout=10).text
    in_flight = [line for line in metrics.splitlines() if line.startswith("pagedserve:proxy_requests_in_flight")]
    assert in_flight and all(line.endswith(" 0.0") for line in in_flight), in_flight


def test_a_proxy_in_the_other_mode_refuses_to_start(cluster, capsys):
    """A pull-mode proxy over push-mode instances stops at start with an error naming both modes."""
    from pagedserve.cli import main
    from pagedserve.proxy.pd_proxy import PDProxy

    proxy = PDProxy([cluster["prefill"].base_url], [cluster["decode"].base_url], kv_transfer_mode="pull")
    with pytest.raises(ValueError, match=r"runs kv_connector_extra_config.mode='push', but this proxy runs "
                                         r"--kv-transfer-mode 'pull'"):
        asyncio.run(proxy.start())
    # `pagedserve proxy` itself: exit status 2 and the same error (pull is the default mode).
    status = main(["proxy", "--prefill", cluster["prefill"].base_url, "--decode", cluster["decode"].base_url,
                   "--port", "1"])
    assert status == 2 and "--kv-transfer-mode 'pull'" in capsys.readouterr().err


def gauge(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


def test_p_dying_mid_request_fails_it_and_d_frees_its_blocks(cluster, client):
    """P frozen, so that the request is in flight at both (D holds its reserved blocks, waiting for P's layers),
    then killed: the request fails with a 502 naming P, the proxy cancels D's call, which frees D's blocks; the next
    request finds P down (503). The proxy's probe is slow here, so the request, not the probe, finds P dead."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    os.killpg(prefill.process.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.completions.create, model=cluster["model"], prompt=PROMPTS[1], max_tokens=4)
            deadline = time.monotonic() + 20
            while gauge(decode, "vllm:num_requests_waiting") < 1:  # D reserved its blocks and waits for P
                assert time.monotonic() < deadline and not pending.done(), "D never got the request"
                time.sleep(0.05)
            assert kv_cache_usage(decode) > 0
            os.killpg(prefill.process.pid, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError, match=f"prefill instance {prefill.base_url}") as error:
                pending.result(timeout=60)
    finally:
        os.killpg(prefill.process.pid, signal.SIGKILL)
    assert error.value.status_code in (502, 503)
    with pytest.raises(openai.APIStatusError, match="no prefill instance is up"):
        client.chat.completions.create(model=cluster["model"], messages=MESSAGES, max_tokens=4, stream=True)
    wait_until_every_block_is_free([decode])
    assert gauge(decode, "vllm:num_requests_waiting") == 0 and gauge(decode, "vllm:num_requests_running") == 0
