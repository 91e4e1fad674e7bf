"""The engine <-> server codec: typed msgpack round trips, and no way to smuggle other types in."""
from __future__ import annotations

import msgspec
import pytest

from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler_output import LogprobsLists
from pagedserve.engine.messages import (AbortRequests, AddRequests, EngineCoreOutputs, EngineReady, MessageCodec,
                                        UtilityCall, UtilityResult)
from pagedserve.sampling_params import SamplingParams


def test_add_requests_round_trip_keeps_every_field():
    codec = MessageCodec()
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x"], max_tokens=9, logprobs=2,
                            n=1).clone(all_stop_token_ids={2, 7})
    request = Request("r-1", [1, 2, 3], params, eos_token_id=2, priority=4, cache_salt="salt")
    decoded = codec.decode_input(codec.encode(AddRequests(requests=[request])))
    assert isinstance(decoded, AddRequests)
    got = decoded.requests[0]
    for name in ("request_id", "prompt_token_ids", "eos_token_id", "arrival_time", "priority", "cache_salt",
                 "status"):
        assert getattr(got, name) == getattr(request, name), name
    assert got.sampling_params == params
    assert got.sampling_params.all_stop_token_ids == {2, 7}


def test_abort_and_utility_round_trip():
    codec = MessageCodec()
    message = AbortRequests(request_ids=["a", "b"], status=RequestStatus.FINISHED_STOPPED)
    abort = codec.decode_input(codec.encode(message))
    assert abort == AbortRequests(request_ids=["a", "b"], status=RequestStatus.FINISHED_STOPPED)
    assert isinstance(abort.status, RequestStatus)
    assert codec.decode_input(codec.encode(UtilityCall(call_id=3, method="ping"))) == UtilityCall(call_id=3,
                                                                                                  method="ping")


def test_outputs_round_trip():
    codec = MessageCodec()
    outputs = [EngineCoreOutput("a", [5], LogprobsLists([[5, 6]], [[-0.5, -1.0]], [1]), finish_reason="stop",
                                stop_reason=9, num_cached_tokens=16)]
    stats = SchedulerStats(num_running_requests=1, kv_cache_usage=0.25, prefix_cache_hits=16)
    decoded = codec.decode_output(codec.encode(EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=1.5)))
    assert decoded.outputs == outputs and decoded.stats == stats
    ready = codec.decode_output(codec.encode(EngineReady(pid=1, num_kv_blocks=2, max_model_len=3)))
    assert ready == EngineReady(pid=1, num_kv_blocks=2, max_model_len=3)
    assert codec.decode_output(codec.encode(UtilityResult(call_id=1, result="pong"))).result == "pong"


def test_garbage_and_wrong_direction_are_rejected():
    codec = MessageCodec()
    with pytest.raises(msgspec.DecodeError):
        codec.decode_input(b"\xc1not msgpack")
    with pytest.raises(msgspec.ValidationError):
        codec.decode_input(codec.encode(EngineReady(pid=1, num_kv_blocks=2, max_model_len=3)))
    with pytest.raises(msgspec.ValidationError):
        codec.decode_input(msgspec.msgpack.encode({"type": "add", "requests": [{"request_id": 5}]}))
