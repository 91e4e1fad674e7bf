"""SparseKVOffloadConfig: parsing (dict, JSON, the CLI flag) and the errors that name the knob, the value and the
limit."""
from __future__ import annotations

import argparse

import pytest

from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
from pagedserve.config.sparse_kv_offload import SparseKVOffloadConfig

_ENGINE = dict(architectures=["DeepseekV32ForCausalLM"], kv_cache_dtype="auto", device_type="cpu",
               speculative_enabled=False, tensor_parallel_size=1, pipeline_parallel_size=1)


def test_parse_dict_json_and_none(tmp_path) -> None:
    assert SparseKVOffloadConfig.parse(None) is None
    assert SparseKVOffloadConfig.parse({"num_resident_blocks": 4}) == SparseKVOffloadConfig(4)
    parsed = SparseKVOffloadConfig.parse(f'{{"num_resident_blocks": 2, "tier_directory": "{tmp_path}"}}')
    assert parsed == SparseKVOffloadConfig(2, str(tmp_path))


def test_cli_flag_reaches_the_engine_keyword() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--sparse-kv-offload", '{"num_resident_blocks": 8}'])
    assert SparseKVOffloadConfig.parse(engine_kwargs_from_args(args)["sparse_kv_offload"]) == SparseKVOffloadConfig(8)


@pytest.mark.parametrize("value, message", [
    ({"num_resident_blocks": 0}, r"sparse_kv_offload.num_resident_blocks=0 must be an integer >= 1"),
    ({"num_resident_blocks": True}, r"num_resident_blocks=True must be an integer >= 1"),
    ({"num_resident_blocks": "8"}, r"num_resident_blocks='8' must be an integer >= 1"),
    ({}, r"must give num_resident_blocks"),
    ({"num_resident_blocks": 2, "topk_buffer_size": 4}, r"unknown keys \['topk_buffer_size'\]"),
    ("{not json", r"sparse_kv_offload='\{not json' is not a JSON object"),
    ({"num_resident_blocks": 2, "tier_directory": "/no/such/folder"}, r"tier_directory='/no/such/folder' is not an "
                                                                      r"existing directory"),
    ({"num_resident_blocks": 2, "tier_directory": ""}, r"tier_directory='' must be a non-empty path"),
])
def test_bad_values_are_named(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SparseKVOffloadConfig.parse(value)


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["LlamaForCausalLM"]), r"needs a model whose attention runs a lightning indexer .* "
                                               r"LlamaForCausalLM has none"),
    (dict(kv_cache_dtype="int8"), r"cannot be combined with kv_cache_dtype='int8'"),
    (dict(device_type="cuda"), r"CPU platform only so far \(this is cuda\)"),
    (dict(speculative_enabled=True), r"cannot be combined with speculative_config"),
    (dict(tensor_parallel_size=2), r"needs tensor_parallel_size=1 and pipeline_parallel_size=1 \(got 2 and 1\)"),
])
def test_engine_combinations_that_cannot_offload_are_refused(change: dict, message: str) -> None:
    SparseKVOffloadConfig(4).check_engine(**_ENGINE)
    with pytest.raises(ValueError, match=message):
        SparseKVOffloadConfig(4).check_engine(**(_ENGINE | change))
