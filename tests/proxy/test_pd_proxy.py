"""`pagedserve proxy` end to end: real P and D servers (PullConnector over zmq), the proxy, the real openai client.

One set of processes serves the module (two engines, to stay cheap on 2 cores): P (kv_both: the proxy's prefill
instance and one of its two decode instances) and D (kv_consumer, the other decode instance), and a proxy over them
that also lists a prefill URL nobody listens at. The last test kills D while it holds a stream, so it runs last.
P's answers to requests without kv_transfer_params are the one-engine reference (P is an ordinary engine for
them).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))

from server_process import ServerProcess, free_port  # noqa: E402

# As tests/server/conftest.py's servers: a 2048-token context, long enough to catch a stream mid-way.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", "192", "--block-size", "16"]
# P frees blocks no consumer fetched after free_timeout_s (here a D that refused the request, or died): short, so
# that the last test sees every block free through /metrics.
FREE_TIMEOUT_S = 10
PRODUCER = {"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"free_timeout_s": FREE_TIMEOUT_S}}
CONSUMER = {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}
PROMPTS = ["hello world", "the quick brown fox jumps over", "one two three four five six seven eight nine ten"]


class ProxyProcess:
    """`pagedserve proxy` as a child process in its own session (killed as a group on stop)."""

    def __init__(self, prefill: list[str], decode: list[str], extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedserve-proxy-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "pagedserve.cli", "proxy", "--prefill", *prefill, "--decode", *decode,
                   "--port", str(self.port), "--health-interval", "0.5", *extra_args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy did not start:\n{open(self.log.name).read()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        self.log.close()


def start_servers(model: str, launches: list[list[str]]) -> list[ServerProcess]:
    """One server per launch's arguments, started at once; when one fails to start, the others are stopped and its
    error raised."""
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = [pool.submit(ServerProcess, model, args) for args in launches]
    # Leaving the pool waited for every start.
    started = [future.result() for future in futures if future.exception() is None]
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:
        for server in started:
            server.stop(timeout=3)
        raise errors[0]
    return started


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    model = tiny_model_dir("llama")
    servers: list[ServerProcess] = []
    proxy = None
    try:
        servers = start_servers(model, [ENGINE_ARGS + ["--kv-transfer-config", json.dumps(role)]
                                        for role in (PRODUCER, CONSUMER)])
        unreachable = f"http://127.0.0.1:{free_port()}"
        proxy = ProxyProcess([servers[0].base_url, unreachable], [servers[1].base_url, servers[0].base_url])
        yield {"prefill": servers[0], "decode": [servers[1], servers[0]], "proxy": proxy, "unreachable": unreachable,
               "model": model.rstrip("/")}
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop(timeout=3)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster['proxy'].base_url}/v1", api_key="none", max_retries=0, timeout=60)


def one_engine_token_ids(cluster, prompt: str, max_tokens: int) -> list[int]:
    """Greedy token ids from P alone, as an ordinary engine (no kv_transfer_params)."""
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{cluster['prefill'].base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def proxy_metrics(cluster) -> dict[tuple[str, str, str], float]:
    """{(metric name, role, instance url): value} from the proxy's /metrics."""
    text = httpx.get(f"{cluster['proxy'].base_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("pagedserve:proxy_"):
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            instance = labels.split('instance="', 1)[1].split('"', 1)[0]
            role = labels.split('role="', 1)[1].split('"', 1)[0]
            values[(name, role, instance)] = float(value)
    return values


def kv_cache_usage(server) -> float:
    """The server's vllm:kv_cache_usage_perc (referenced blocks / usable blocks) from its /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")).split()[-1])


def wait_until_every_block_is_free(servers, timeout_s: float = 30.0) -> None:
    """Every KV block of every server unreferenced, as /metrics shows it (P frees a request's held blocks when
    D's done notice arrives, after D's answer may already be back)."""
    deadline = time.monotonic() + timeout_s
    while (usage := {server.base_url: kv_cache_usage(server) for server in servers}) and any(usage.values()):
        assert time.monotonic() < deadline, f"KV blocks still in use: {usage}"
        time.sleep(0.2)


def test_servers_pass_kv_transfer_params(cluster):
    """The OpenAI server takes kv_transfer_params in (P: do_remote_decode) and gives P's back, completions and chat;
    D given them decodes the same greedy tokens as one engine."""
    prefill, decode = cluster["prefill"].base_url, cluster["decode"][0].base_url
    body = {"model": cluster["model"], "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60).json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] and params["remote_port"] > 0
    decoded = httpx.post(f"{decode}/v1/completions", timeout=60, json={
        "model": cluster["model"], "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": params}).json()
    assert decoded["choices"][0]["token_ids"] == one_engine_token_ids(cluster, PROMPTS[1], 8)
    assert decoded["kv_transfer_params"] is None
    chat = httpx.post(f"{prefill}/v1/chat/completions", timeout=60, json={
        "model": cluster["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    assert chat["kv_transfer_params"]["do_remote_prefill"] is True
    # D takes the chat's KV too (else P holds its blocks until free_timeout_s: every block must be free later).
    chat_decoded = httpx.post(f"{decode}/v1/chat/completions", timeout=60, json={
        "model": cluster["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "kv_transfer_params": chat["kv_transfer_params"]})
    assert chat_decoded.status_code == 200, chat_decoded.text
    two_prompts = httpx.post(f"{prefill}/v1/completions", timeout=60, json=dict(body, prompt=["a", "b"]))
    assert two_prompts.status_code == 400 and "one prompt" in two_prompts.json()["error"]["message"]
    not_a_dict = httpx.post(f"{prefill}/v1/completions", timeout=60, json=dict(body, kv_transfer_params=[1]))
    assert not_a_dict.status_code == 422


def test_greedy_through_the_proxy_equals_one_engine(cluster, client):
    for prompt in PROMPTS:
        completion = client.completions.create(model=cluster["model"], prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert completion.choices[0].token_ids == one_engine_token_ids(cluster, prompt, 12)
        assert completion.usage.completion_tokens == 12
    wait_until_every_block_is_free([cluster["prefill"], *cluster["decode"]])


def test_streaming_through_the_proxy(cluster, client):
    whole = client.completions.create(model=cluster["model"], prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=cluster["model"], prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one piece
    assert chunks[-1].usage.completion_tokens == 10
    messages = [{"role": "user", "content": "tell me a story"}]
    chat = client.chat.completions.create(model=cluster["model"], messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    streamed = client.chat.completions.create(model=cluster["model"], messages=messages, max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [cluster["model"]]


def test_errors_are_openai_errors_naming_the_instance(cluster, client):
    with pytest.raises(openai.BadRequestError, match=f"prefill instance {cluster['prefill'].base_url}.*temperature"):
        client.completions.create(model=cluster["model"], prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="prefill instance .*does not exist"):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    decode_error = httpx.post(f"{cluster['proxy'].base_url}/v1/completions", timeout=60, json={
        "model": cluster["model"], "prompt": "x", "max_tokens": 4, "n": 2})  # D refuses n > 1 with its KV pulled
    assert decode_error.status_code == 400
    assert decode_error.json()["error"]["message"].startswith("decode instance http://127.0.0.1:")
    not_json = httpx.post(f"{cluster['proxy'].base_url}/v1/completions", content=b"{", timeout=10)
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "BadRequestError"
    for bad_id in ("", 7, "x" * 257):
        refused = httpx.post(f"{cluster['proxy'].base_url}/v1/completions", timeout=10, json={
            "model": cluster["model"], "prompt": "x", "max_tokens": 4, "request_id": bad_id})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id", refused.text


def test_the_caller_s_request_id_names_the_request_on_every_instance(cluster):
    """X-Request-Id, else the body's request_id, is the id of the proxy's answer and of the request on D (P runs it
    suffixed), as a server alone takes it."""
    base = cluster["proxy"].base_url
    body = {"model": cluster["model"], "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    by_header = httpx.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert by_header.status_code == 200, by_header.text
    assert by_header.headers["x-request-id"] == "trace-7" and by_header.json()["id"] == "cmpl-trace-7"
    by_body = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": cluster["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "request_id": "mine-8"})
    assert by_body.status_code == 200, by_body.text
    assert by_body.headers["x-request-id"] == "mine-8" and by_body.json()["id"] == "chatcmpl-mine-8"
    wait_until_every_block_is_free([cluster["prefill"], *cluster["decode"]])


def test_metrics_count_per_instance_and_least_loaded_spreads(cluster):
    metrics = proxy_metrics(cluster)
    prefill, (first, second) = cluster["prefill"].base_url, (d.base_url for d in cluster["decode"])
    # The unreachable prefill instance was found dead by the first probe and never got a request.
    assert metrics[("pagedserve:proxy_instance_up", "prefill", cluster["unreachable"])] == 0
    assert metrics[("pagedserve:proxy_requests_total", "prefill", cluster["unreachable"])] == 0
    assert metrics[("pagedserve:proxy_requests_total", "prefill", prefill)] >= 8
    # Sequential requests: both decode instances idle each time, so the one that has served fewer is picked.
    assert abs(metrics[("pagedserve:proxy_requests_total", "decode", first)]
               - metrics[("pagedserve:proxy_requests_total", "decode", second)]) <= 1
    assert all(value == 0 for (name, _, _), value in metrics.items() if name in (
        "pagedserve:proxy_requests_in_flight", "pagedserve:proxy_failures_total"))


def test_a_push_mode_proxy_refuses_pull_mode_instances(cluster):
    """The instances run the pull mode: a proxy started in push mode stops at start naming both modes; so does
    one over an instance that cannot say its mode."""
    import asyncio

    from pagedserve.proxy.pd_proxy import PDProxy

    proxy = PDProxy([cluster["prefill"].base_url], [cluster["decode"][0].base_url], kv_transfer_mode="push")
    with pytest.raises(ValueError, match=r"runs kv_connector_extra_config.mode='pull', but this proxy runs "
                                         r"--kv-transfer-mode 'push'"):
        asyncio.run(proxy.start())
    # Something that is no pagedserve server (here the proxy itself) cannot say its mode: refused too.
    proxy = PDProxy([cluster["proxy"].base_url], [cluster["decode"][0].base_url])
    with pytest.raises(ValueError, match=f"prefill instance {cluster['proxy'].base_url} has no GET "
                                         f"/kv_transfer_info"):
        asyncio.run(proxy.start())


def test_a_dead_decode_instance_fails_its_stream_and_the_others_serve(cluster, client):
    doomed, survivor = cluster["decode"]

    def served(instance) -> float:
        return proxy_metrics(cluster)[("pagedserve:proxy_requests_total", "decode", instance.base_url)]

    def in_flight(instance) -> float:
        return proxy_metrics(cluster)[("pagedserve:proxy_requests_in_flight", "decode", instance.base_url)]

    # A stream of an earlier test whose client left is released when the proxy notices: start from both idle (a
    # count that never returns to 0 is a leak).
    deadline = time.monotonic() + 30
    while any(in_flight(instance) for instance in cluster["decode"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [in_flight(instance) for instance in cluster["decode"]] == [0, 0]
    # Least-loaded picks the survivor while it has served fewer (earlier tests may have left any difference):
    # even up, so that the next request goes to `doomed` (the first listed).
    for _ in range(8):
        if served(survivor) >= served(doomed):
            break
        client.completions.create(model=cluster["model"], prompt="x", max_tokens=1)

    def open_stream(max_tokens: int):
        stream = client.completions.create(model=cluster["model"], prompt=PROMPTS[0], max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        return stream, next(chunks).choices[0].text, chunks

    served_before = {instance.base_url: served(instance) for instance in cluster["decode"]}
    long_stream = open_stream(1500)  # to `doomed` (both idle, it has served no more than the survivor)
    # Frozen mid-answer, so that the stream is still in flight when it dies however fast the machine decodes (a
    # stopped server's late /health answers keep it up on the proxy's side).
    os.killpg(doomed.process.pid, signal.SIGSTOP)
    short_stream = open_stream(100)  # to the survivor (least-loaded: `doomed` has one in flight)
    metrics = proxy_metrics(cluster)
    # Each instance got one stream; the short one may already be whole on the proxy's side (no longer in flight).
    assert all(metrics[("pagedserve:proxy_requests_total", "decode", url)] == count + 1
               for url, count in served_before.items())
    assert metrics[("pagedserve:proxy_requests_in_flight", "decode", doomed.base_url)] == 1
    os.killpg(doomed.process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match=f"decode instance {doomed.base_url} failed while answering"):
        for _ in long_stream[2]:
            pass
    stream, first_text, chunks = short_stream
    text = first_text + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == client.completions.create(model=cluster["model"], prompt=PROMPTS[0], max_tokens=100,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    for prompt in PROMPTS:  # the live decode instance serves every new request
        completion = client.completions.create(model=cluster["model"], prompt=prompt, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert completion.choices[0].token_ids == one_engine_token_ids(cluster, prompt, 6)
    # P (the survivor) ends with every block free: fetched blocks at once, those of requests D refused
    # (test_errors_are_openai_errors_naming_the_instance) after free_timeout_s.
    wait_until_every_block_is_free([survivor], timeout_s=3 * FREE_TIMEOUT_S)
    metrics = proxy_metrics(cluster)
    assert metrics[("pagedserve:proxy_failures_total", "decode", doomed.base_url)] == 1
    assert metrics[("pagedserve:proxy_instance_up", "decode", doomed.base_url)] == 0
    assert httpx.get(f"{cluster['proxy'].base_url}/health", timeout=10).status_code == 200
