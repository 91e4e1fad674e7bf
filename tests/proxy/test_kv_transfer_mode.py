"""The proxy's instance checks per KV transfer mode, the bodies and kv_transfer_params it sends, and the
/kv_transfer_info answer they rest on (pure: no server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
from pagedserve.kv_transfer.push_producer_rank import push_producer_rank
from pagedserve.proxy.instance_pool import DECODE, PREFILL
from pagedserve.proxy.kv_transfer_mode import (instance_error, prefill_body, prefill_headers, prefill_request_id,
                                               push_kv_transfer_params)


def info(role: str, mode: str = "push", connector: str | None = "PullConnector") -> KVTransferInfo:
    return KVTransferInfo(connector, role, mode, "p-0", "127.0.0.1" if role != "kv_consumer" else "",
                          [5600] if role != "kv_consumer" else [])


def test_roles_and_modes_that_fit_and_those_that_do_not() -> None:
    assert instance_error("P", PREFILL, info("kv_producer"), "push") is None
    assert instance_error("P", PREFILL, info("kv_both"), "push") is None
    assert instance_error("D", DECODE, info("kv_consumer"), "push") is None
    assert "mode='pull', but this proxy runs --kv-transfer-mode 'push'" in instance_error(
        "P", PREFILL, info("kv_producer", "pull"), "push")
    assert "mode='push', but this proxy runs --kv-transfer-mode 'pull'" in instance_error(
        "D", DECODE, info("kv_consumer", "push"), "pull")
    assert "a prefill instance behind the proxy needs kv_connector 'PullConnector' with kv_role 'kv_producer'" in \
        instance_error("P", PREFILL, info("kv_consumer"), "push")
    assert "D runs no kv_transfer_config" in instance_error("D", DECODE, KVTransferInfo(), "pull")


def test_the_info_of_an_engine_and_its_json() -> None:
    producer = KVTransferConfig(kv_connector="PullConnector", kv_role="kv_producer",
                                kv_connector_extra_config={"mode": "push", "host": "10.0.0.2"})
    got = KVTransferInfo.from_engine(producer, "engine-7", [5601])
    assert got == KVTransferInfo("PullConnector", "kv_producer", "push", "engine-7", "10.0.0.2", [5601],
                                 [{"engine_id": "engine-7", "ports": [5601]}])
    assert KVTransferInfo.from_json(got.to_json()) == got
    # A MultiConnector's PullConnector part; a consumer advertises no address.
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer", kv_connector_extra_config={
        "connectors": [{"kv_connector": "PoolConnector", "kv_connector_extra_config": {"backend": "local"}},
                       {"kv_connector": "PullConnector"}]})
    part = KVTransferInfo.from_engine(multi, "", [])
    assert (part.kv_connector, part.kv_role, part.mode, part.ports) == ("PullConnector", "kv_consumer", "pull", [])
    assert KVTransferInfo.from_engine(None, "", []) == KVTransferInfo()
    with pytest.raises(ValueError, match="needs a host and ports"):
        KVTransferInfo.from_json(got.to_json() | {"ports": []})
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVTransferInfo.from_json([1])


def test_what_the_proxy_sends_p_and_d() -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "n": 1, "stop": ["a"], "temperature": 0,
            "request_id": "client"}
    assert prefill_body(body) == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "temperature": 0,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert prefill_headers({"authorization": "k", "X-Request-Id": "r1"}) == {"authorization": "k",
                                                                             "X-Request-Id": "r1-prefill"}
    assert push_kv_transfer_params(info("kv_producer"), prefill_request_id("r1")) == {
        "do_remote_prefill": True, "remote_engine_id": "p-0", "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_block_ids": [], "remote_request_id": "r1-prefill"}
    two_ranks = KVTransferInfo("PullConnector", "kv_producer", "push", "p", "h", [5600, 5601])
    assert push_kv_transfer_params(two_ranks, "r")["remote_ports"] == [5600, 5601]


def test_push_params_name_the_producer_rank_the_request_id_picks() -> None:
    """A push-mode P with several DP ranks runs a request on push_producer_rank(its id): D's kv_transfer_params name
    that rank's engine id and ports; a P with one rank (or an older server without data_parallel_ranks) its own."""
    ranks = [{"engine_id": "p_dp0", "ports": [5600]}, {"engine_id": "p_dp1", "ports": [5601]}]
    producer = KVTransferInfo("PullConnector", "kv_producer", "push", "p_dp0", "127.0.0.1", [5600], ranks)
    for request_id in ("p4", "p5", "p6", "p7"):
        rank = push_producer_rank(request_id, 2)
        params = push_kv_transfer_params(producer, request_id)
        assert (params["remote_engine_id"], params["remote_port"]) == (f"p_dp{rank}", 5600 + rank)
        assert "remote_ports" not in params
    one_rank = KVTransferInfo("PullConnector", "kv_producer", "push", "p", "127.0.0.1", [5600],
                                [{"engine_id": "p", "ports": [5600]}])
    assert push_kv_transfer_params(one_rank, "p5")["remote_engine_id"] == "p"
    older = KVTransferInfo("PullConnector", "kv_producer", "push", "p", "127.0.0.1", [5600, 5601])
    assert push_kv_transfer_params(older, "p5")["remote_ports"] == [5600, 5601]


def test_push_producer_rank_is_the_same_in_every_process() -> None:
    """The rank is a function of the id alone: another interpreter (another hash seed) computes the same ranks, and
    ids one character apart spread over the ranks."""
    request_ids = [f"chatcmpl-{index}" for index in range(64)]
    here = [push_producer_rank(request_id, 3) for request_id in request_ids]
    script = ("import json, sys; from pagedserve.kv_transfer.push_producer_rank import push_producer_rank; "
              "print(json.dumps([push_producer_rank(i, 3) for i in json.loads(sys.argv[1])]))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    there = subprocess.run([sys.executable, "-c", script, json.dumps(request_ids)], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=root)).stdout
    assert json.loads(there) == here
    assert all(here.count(rank) >= 10 for rank in range(3))
    with pytest.raises(ValueError, match="data_parallel_size=0 must be >= 1"):
        push_producer_rank("x", 0)
