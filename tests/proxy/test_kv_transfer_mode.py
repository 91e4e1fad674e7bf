"""The proxy's instance checks per KV transfer mode, the bodies and kv_transfer_params it sends, and the
/kv_transfer_info answer they rest on (pure: no server)."""
from __future__ import annotations

import pytest

from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
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
