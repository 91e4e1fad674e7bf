"""PullConnector with data_parallel_size 2: every DP rank is its own P or D engine with its own connector (engine id
`<engine_id>_dp<rank>`, kv_port + rank). P DP=2 -> D DP=1, P DP=1 -> D DP=2 and P DP=2 -> D DP=2 give
one engine's greedy tokens for requests that land on both ranks: a P rank's kv_transfer_params name that rank, a D
rank pulls the requests its coordinator gave it and computes only each prompt's last token; every block ends free on
every rank of both sides.

Both engines run in the test's process (DataParallelEngineCore steps its ranks in turn; block servers are threads).
"""
from __future__ import annotations

import socket
from typing import Any

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from test_pull_connector import (ENGINE_KWARGS, GREEDY, assert_all_blocks_free, consumer_config, cores,
                                 remote_params, token_ids)

NUM_PROMPTS = 4
PREFILL = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def free_port_pair() -> int:
    """A port p with p and p + 1 free right now (P's two DP ranks bind kv_port + rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base >= 65535:
            continue
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", base))
                second.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def record_first_steps(llm: LLM) -> list[dict[str, int]]:
    """Per DP rank, per request id, the tokens the first step that scheduled it computed (a spy on each rank's
    worker)."""
    seen: list[dict[str, int]] = []
    for core in cores(llm):
        worker = core.executor.worker
        rank_seen: dict[str, int] = {}
        seen.append(rank_seen)

        def spy(scheduler_output, execute=worker.execute_model, rank_seen=rank_seen):  # type: ignore[no-untyped-def]
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                rank_seen.setdefault(request_id, num_tokens)
            return execute(scheduler_output)

        worker.execute_model = spy
    return seen


def producer(model: str, data_parallel_size: int, **config: Any) -> LLM:
    return LLM(model, data_parallel_size=data_parallel_size, kv_transfer_config={
        "kv_connector": "PullConnector", "kv_role": "kv_producer", **config}, **ENGINE_KWARGS)


def check_pd(model: str, producer_dp: int, consumer_dp: int, seed: int) -> None:
    """P with `producer_dp` DP ranks, D with `consumer_dp`: greedy tokens equal one engine's, every request on
    both sides' ranks, every block free afterwards."""
    prompts = random_prompts(NUM_PROMPTS, 20, 45, seed=seed)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    base_port = free_port_pair() if producer_dp > 1 else 0
    prefill_engine = producer(model, producer_dp, engine_id="prefill", kv_port=base_port)
    decode_engine = LLM(model, data_parallel_size=consumer_dp, kv_transfer_config=consumer_config(policy="fail"),
                        **ENGINE_KWARGS)
    try:
        params = [output.kv_transfer_params for output in prefill_engine.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], PREFILL, use_tqdm=False)]
        if producer_dp > 1:
            # Each P rank names itself: its engine id and its own port (kv_port + DP rank).
            assert sorted({(item["remote_engine_id"], item["remote_port"]) for item in params}) == [
                ("prefill_dp0", base_port), ("prefill_dp1", base_port + 1)]
            assert [core.runtime_info.kv_transfer_port for core in cores(prefill_engine)] == [base_port,
                                                                                             base_port + 1]
        else:
            assert {item["remote_engine_id"] for item in params} == {"prefill"}
        first_steps = record_first_steps(decode_engine)
        outputs = decode_engine.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                                         [remote_params(item) for item in params], use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        # Every D rank that got requests pulled their prompts: its first step of each computed one token.
        assert [sorted(rank_steps.values()) for rank_steps in first_steps] == \
            [[1] * (NUM_PROMPTS // consumer_dp)] * consumer_dp
        if consumer_dp > 1:
            assert decode_engine.llm_engine.engine_core.requests_routed_per_rank == [NUM_PROMPTS // 2] * 2
        assert_all_blocks_free(decode_engine, timeout_s=30)
        # D's done notices reached the P rank that held each request's blocks.
        assert_all_blocks_free(prefill_engine, timeout_s=30)
        if producer_dp > 1:
            assert prefill_engine.llm_engine.engine_core.requests_routed_per_rank == [NUM_PROMPTS // 2] * 2
    finally:
        prefill_engine.llm_engine.shutdown()
        decode_engine.llm_engine.shutdown()


def test_data_parallel_producer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    check_pd(tiny_model_dir("llama"), producer_dp=2, consumer_dp=1, seed=41)


def test_data_parallel_consumer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    check_pd(tiny_model_dir("llama"), producer_dp=1, consumer_dp=2, seed=42)


def test_data_parallel_producer_and_consumer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    check_pd(tiny_model_dir("llama"), producer_dp=2, consumer_dp=2, seed=43)


def test_producer_ranks_reported_to_the_server(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """What the engine process reports for GET /kv_transfer_info: every DP rank's engine id and bound ports."""
    from pagedserve.engine.engine_core_proc import _kv_transfer_ranks
    from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo

    prefill_engine = producer(tiny_model_dir("llama"), 2, engine_id="p")
    try:
        ranks = _kv_transfer_ranks(prefill_engine.llm_engine.engine_core)
        bound = [core.runtime_info.kv_transfer_port for core in cores(prefill_engine)]
        assert ranks == [{"engine_id": "p_dp0", "ports": [bound[0]]}, {"engine_id": "p_dp1", "ports": [bound[1]]}]
        assert len(set(bound)) == 2 and 0 not in bound
        info = KVTransferInfo.from_engine(prefill_engine.llm_engine.config.kv_transfer_config, ranks[0]["engine_id"],
                                          ranks[0]["ports"], ranks)
        assert (info.engine_id, info.ports, info.data_parallel_ranks) == ("p_dp0", [bound[0]], ranks)
        assert KVTransferInfo.from_json(info.to_json()) == info
    finally:
        prefill_engine.llm_engine.shutdown()
