"""kv_transfer_config and kv_transfer_params: bad input is refused at start (or at SamplingParams) with the field,
the value and what is allowed."""
from __future__ import annotations

import argparse

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
from pagedserve.config.engine import EngineConfig
from pagedserve.config.kv_transfer import KVTransferConfig


@pytest.mark.parametrize("value, message", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
     "kv_transfer_config.kv_connector='NixlConnector' must be one of ['PullConnector', 'PoolConnector', "
     "'MultiConnector']"),
    ({"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "lmcache"}},
     "kv_connector_extra_config.backend='lmcache' must be one of ['redis', 'mooncake', 'local']"),
    ({"kv_connector": "PoolConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"backend": "mooncake", "url": "redis://127.0.0.1:6379/0"}},
     "url='redis://127.0.0.1:6379/0' does not fit backend='mooncake'"),
    ({"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"host": "x"}},
     "kv_connector_extra_config has unknown keys ['host'] for PoolConnector"),
    ({"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"lookup_timeout_s": 0}},
     "kv_connector_extra_config.lookup_timeout_s=0 must be a number > 0"),
    ({"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"max_pending_puts": 0}},
     "kv_connector_extra_config.max_pending_puts=0 must be an integer >= 1"),
    ({"kv_connector": "PullConnector"}, "kv_transfer_config.kv_role is missing"),
    ({"kv_connector": "PullConnector", "kv_role": "prefill"}, "kv_transfer_config.kv_role='prefill' must be one of"),
    ('{"kv_connector": "PullConnector", ', "kv_transfer_config='{\"kv_connector\": \"PullConnector\", ' is not a "
                                           "JSON object"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_port": 70000},
     "kv_transfer_config.kv_port=70000 must be an integer in [0, 65535]"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_transfer_config.kv_load_failure_policy='retry' must be one of ['recompute', 'fail']"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"transport": "rdma"}},
     "transport='rdma' must be one of ['zmq', 'mooncake']"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"mode": "stream"}},
     "kv_transfer_config.kv_connector_extra_config.mode='stream' must be one of ['pull', 'push']"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"mode": "push", "transport": "mooncake"}},
     "kv_connector_extra_config.mode='push' cannot run over transport='mooncake': push needs transport one of "
     "['zmq']"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "PullConnector", "kv_connector_extra_config": {"mode": "Push"}}]}},
     "kv_connector_extra_config.mode='Push' must be one of ['pull', 'push']"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "x"}},
     "kv_connector_extra_config has unknown keys ['backend'] for PullConnector"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"transfer_timeout_s": 0}},
     "kv_connector_extra_config.transfer_timeout_s=0 must be a number > 0"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both"},
     "kv_connector_extra_config.connectors=None must be a non-empty list"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "PullConnector", "kv_role": "kv_producer"},
                       {"kv_connector": "PullConnector", "kv_role": "kv_both"}]}},
     "holds more than one producer"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_both", "kv_rank": 0},
     "kv_transfer_config has unknown keys ['kv_rank']"),
])
def test_bad_kv_transfer_config(value, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as error:
        KVTransferConfig.parse(value)
    assert message in str(error.value)


def test_multi_connector_parts_inherit_role() -> None:
    config = KVTransferConfig.parse({"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "engine_id": "d",
                                     "kv_connector_extra_config": {"connectors": [{"kv_connector": "PullConnector"}]}})
    assert config is not None
    (part,) = config.connector_configs
    assert (part.kv_role, part.engine_id, part.is_consumer, part.is_producer) == ("kv_consumer", "d-0", True, False)


@pytest.mark.parametrize("engine_kwargs, message", [
    (dict(prefill_context_parallel_size=2), "is not supported with context parallelism yet: "
                                            "decode_context_parallel_size and prefill_context_parallel_size must be 1 "
                                            "(got (1, 2))"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="ray"), "distributed_executor_backend='ray'"),
])
def test_engine_options_refused_with_a_connector(tiny_model_dir, engine_kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as error:
        EngineConfig.create(tiny_model_dir("llama"), kv_transfer_config={"kv_connector": "PullConnector",
                                                                         "kv_role": "kv_both"}, **engine_kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("engine_kwargs, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size and pipeline_parallel_size must be 1 (got (2, 1))"),
    (dict(distributed_executor_backend="mp"), "distributed_executor_backend None or 'uni' (got 'mp')"),
])
def test_pool_connector_refused_over_several_workers(tiny_model_dir, engine_kwargs, message) -> None:  # type: ignore[no-untyped-def]
    pool = {"kv_connector": "PoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "local"}}
    for config in (pool, {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"connectors": [{"kv_connector": "PullConnector"}, pool]}}):
        with pytest.raises(ValueError) as error:
            EngineConfig.create(tiny_model_dir("llama"), kv_transfer_config=config, **engine_kwargs)
        assert message in str(error.value)


def test_push_mode_refused_over_several_ranks(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as error:
        EngineConfig.create(tiny_model_dir("llama"), tensor_parallel_size=2, kv_transfer_config={
            "kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"mode": "push"}})
    assert ("kv_connector_extra_config.mode='push' runs with tensor_parallel_size and pipeline_parallel_size 1 for "
            "now (got (2, 1))") in str(error.value)


@pytest.mark.parametrize("kv_transfer_config, engine_kwargs, message", [
    ({"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "PullConnector"}, {"kv_connector": "PoolConnector",
                                            "kv_connector_extra_config": {"backend": "local"}}]}},
     dict(data_parallel_size=2),
     "kv_transfer_config.kv_connector='PoolConnector' is not supported with data_parallel_size=2 yet"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_producer", "kv_port": 65535}, dict(data_parallel_size=2),
     "kv_transfer_config.kv_port=65535: data_parallel_size=2 x 1 worker rank(s) each serve on kv_port + their rank, "
     "up to 65536 > 65535; choose kv_port <= 65534 or 0 (free ports)"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_producer", "kv_port": 65535}, dict(tensor_parallel_size=2),
     "data_parallel_size=1 x 2 worker rank(s) each serve on kv_port + their rank, up to 65536 > 65535"),
    ({"kv_connector": "PullConnector", "kv_role": "kv_producer"},
     dict(data_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray"),
     "distributed_executor_backend='ray'"),
])
def test_data_parallel_refusals(tiny_model_dir, kv_transfer_config, engine_kwargs, message) -> None:  # type: ignore[no-untyped-def]
    """What data_parallel_size > 1 still refuses with a connector: the pool, Ray, ports past 65535."""
    with pytest.raises(ValueError) as error:
        EngineConfig.create(tiny_model_dir("llama"), kv_transfer_config=kv_transfer_config, **engine_kwargs)
    assert message in str(error.value)


def test_data_parallel_ranks_derive_engine_ids_and_ports(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Each DP rank's connector: engine id `<engine_id>_dp<rank>`, kv_port + rank x world_size_per_engine (0 stays
    0), worker rank w of it on + w; a MultiConnector's parts likewise; no connector: the config itself."""
    config = EngineConfig.create(tiny_model_dir("llama"), data_parallel_size=2, kv_transfer_config={
        "kv_connector": "PullConnector", "kv_role": "kv_producer", "engine_id": "prefill", "kv_port": 5600})
    ranks = [config.for_data_parallel_rank(rank).kv_transfer_config for rank in range(2)]
    assert [(part.engine_id, part.kv_port) for part in ranks] == [("prefill_dp0", 5600), ("prefill_dp1", 5601)]
    assert ranks[1].kv_connector_extra_config == config.kv_transfer_config.kv_connector_extra_config
    # Two worker ranks per DP rank (TP=2): DP rank 1's worker ranks serve on 5602 and 5603.
    tp_rank_one = config.kv_transfer_config.for_data_parallel_rank(1, world_size_per_engine=2)
    assert [tp_rank_one.worker_kv_port(rank) for rank in range(2)] == [5602, 5603]
    free = KVTransferConfig(kv_connector="PullConnector", kv_role="kv_producer", engine_id="p")
    assert (free.for_data_parallel_rank(1, 1).kv_port, free.for_data_parallel_rank(1, 1).worker_kv_port(1)) == (0, 0)
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_producer", engine_id="m",
                             kv_connector_extra_config={"connectors": [
                                 {"kv_connector": "PullConnector", "kv_port": 6000},
                                 {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "engine_id": "own"}]})
    parts = multi.for_data_parallel_rank(3, 2).connector_configs
    assert [(part.engine_id, part.kv_port) for part in parts] == [("m_dp3-0", 6006), ("own_dp3", 0)]
    assert multi.connector_configs[1].engine_id == "own"  # the original is unchanged
    plain = EngineConfig.create(tiny_model_dir("llama"), data_parallel_size=2)
    assert plain.for_data_parallel_rank(1) is plain
    with pytest.raises(ValueError, match="data_parallel_rank=-1 must be >= 0"):
        free.for_data_parallel_rank(-1, 1)


def test_cli_flag_parses_json(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_model_dir("llama"), "--kv-transfer-config",
                              '{"kv_connector": "PullConnector", "kv_role": "kv_consumer", "engine_id": "d0"}'])
    config = EngineConfig.create(**engine_kwargs_from_args(args))
    assert config.kv_transfer_config == KVTransferConfig(kv_connector="PullConnector", kv_role="kv_consumer",
                                                         engine_id="d0")


@pytest.mark.parametrize("params, max_tokens, message", [
    ({"do_remote_decode": True}, 16, "do_remote_decode=true needs max_tokens=1 (got max_tokens=16)"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, 1, "sets both do_remote_decode and do_remote_prefill"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, 4, "needs ['remote_engine_id', 'remote_port'"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 0,
      "remote_block_ids": [1], "remote_request_id": "r"}, 4, "remote_port=0 must be an integer in [1, 65535]"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 5,
      "remote_block_ids": [1, -2], "remote_request_id": "r"}, 4, "remote_block_ids=[1, -2] must be a list"),
    ({"do_remote_decode": "yes"}, 1, "kv_transfer_params.do_remote_decode='yes' must be true or false"),
    ({"remote": 1}, 1, "kv_transfer_params has unknown keys ['remote']"),
])
def test_bad_kv_transfer_params(params, max_tokens, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as error:
        SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    assert message in str(error.value)


def test_kv_transfer_params_without_a_connector(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Refused at add_request; the engine goes on serving."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, num_kv_blocks=32, native_decode_stack=False)
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="has kv_transfer_params but the engine has no KV connector"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert not llm.llm_engine.output_processor.has_unfinished_requests()
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0),
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 2
    llm.llm_engine.shutdown()
