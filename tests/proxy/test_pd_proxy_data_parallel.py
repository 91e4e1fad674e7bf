"""P and D servers with data_parallel_size 2 behind the proxy, pull and push mode (slow: two server processes and a
proxy each; tests/kv_transfer/test_pull_connector_data_parallel.py and test_push_connector.py cover the same engines
in process, and the ranks the engine process reports).

P's GET /kv_transfer_info lists both DP ranks (engine ids `<engine_id>_dp<rank>`, their own ports). Pull: P's
answers to concurrent requests name the rank that ran each; D (DP=2) decodes them with one engine's greedy tokens,
directly and through the proxy. Push: through the push proxy, which names the P rank each request's id picks. Every
block ends free on both servers.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from test_pd_proxy import ENGINE_ARGS, ProxyProcess, wait_until_every_block_is_free

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))

from server_process import ServerProcess  # noqa: E402

PRODUCER = {"kv_connector": "PullConnector", "kv_role": "kv_producer", "engine_id": "prefill",
            "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"free_timeout_s": 30}}
CONSUMER = {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}
PROMPTS = ["hello world", "the quick brown fox jumps over", "one two three four five six seven eight nine ten",
           "a b c d e f g h"]
NUM_TOKENS = 8


def in_mode(config: dict, mode: str) -> dict:  # type: ignore[type-arg]
    return config | {"kv_connector_extra_config": config.get("kv_connector_extra_config", {}) | {"mode": mode}}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_data_parallel_servers_through_the_proxy(tiny_model_dir, mode) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_dir("llama")
    args = ENGINE_ARGS + ["--data-parallel-size", "2", "--kv-transfer-config"]
    # Push: P runs each request under the id the proxy sends (X-Request-Id), the id D's order names.
    launches = [args + [json.dumps(in_mode(PRODUCER, mode)), "--enable-request-id-headers"],
                args + [json.dumps(in_mode(CONSUMER, mode))]]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, model, launch) for launch in launches]
        servers = [future.result() if future.exception() is None else None for future in futures]
    proxy = None
    try:
        assert None not in servers, [future.exception() for future in futures]
        prefill, decode = servers
        info = httpx.get(f"{prefill.base_url}/kv_transfer_info", timeout=10).json()
        ranks = info["data_parallel_ranks"]
        assert [rank["engine_id"] for rank in ranks] == ["prefill_dp0", "prefill_dp1"]
        ports = [port for rank in ranks for port in rank["ports"]]
        assert len(ports) == 2 and len(set(ports)) == 2 and 0 not in ports
        assert (info["engine_id"], info["ports"]) == ("prefill_dp0", ranks[0]["ports"])
        decode_info = httpx.get(f"{decode.base_url}/kv_transfer_info", timeout=10).json()
        assert [rank["ports"] for rank in decode_info["data_parallel_ranks"]] == [[], []]

        def complete(base_url: str, prompt: str, **fields) -> dict:  # type: ignore[no-untyped-def]
            body = {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **fields}
            response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            expected = [answer["choices"][0]["token_ids"] for answer in pool.map(
                lambda prompt: complete(prefill.base_url, prompt, max_tokens=NUM_TOKENS), PROMPTS)]
        if mode == "pull":
            pull_directly(complete, prefill, decode, ranks, expected)
        proxy = ProxyProcess([prefill.base_url], [decode.base_url], ("--kv-transfer-mode", mode))
        client = openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            through_proxy = list(pool.map(lambda prompt: client.completions.create(
                model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}), PROMPTS))
        assert [answer.choices[0].token_ids for answer in through_proxy] == expected
        wait_until_every_block_is_free([prefill, decode])
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            if server is not None:
                server.stop(timeout=3)


def pull_directly(complete, prefill, decode, ranks, expected) -> None:  # type: ignore[no-untyped-def]
    """Pull mode without the proxy: concurrent P requests land on both P ranks, each answer names the rank that holds
    its blocks, D decodes them with one engine's tokens."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        params = [answer["kv_transfer_params"] for answer in pool.map(
            lambda prompt: complete(prefill.base_url, prompt, max_tokens=1,
                                    kv_transfer_params={"do_remote_decode": True}), PROMPTS)]
        assert {(item["remote_engine_id"], item["remote_port"]) for item in params} == {
            (rank["engine_id"], rank["ports"][0]) for rank in ranks}
        decoded = list(pool.map(lambda pair: complete(decode.base_url, pair[0], max_tokens=NUM_TOKENS,
                                                      kv_transfer_params=pair[1]), zip(PROMPTS, params)))
    assert [answer["choices"][0]["token_ids"] for answer in decoded] == expected
