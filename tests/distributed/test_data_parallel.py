"""DP coordinator policy on fabricated loads, and DP=2 engine cores end to end (in process, no spawn)."""
from __future__ import annotations

import random

from pagedserve import LLM, SamplingParams
from pagedserve.config.parallel import DyntraLBConfig
from pagedserve.distributed.dp_coordinator import DPCoordinator, RankLoad, exceeds_bubble
from pagedserve.engine.dp_engine_core import DataParallelEngineCore


def _load(waiting: int = 0, running: int = 0, kv: int = 0) -> RankLoad:
    return RankLoad(num_waiting=waiting, num_running=running, num_kv_blocks_used=kv)


def test_routes_to_least_loaded_rank() -> None:
    coordinator = DPCoordinator(num_ranks=3, max_num_seqs=8)
    assert coordinator.choose_rank([_load(1, 2), _load(0, 2), _load(2, 0)]) == 1
    # Equal counts: fewer KV blocks in use wins; then the lower rank.
    assert coordinator.choose_rank([_load(0, 2, kv=30), _load(1, 1, kv=10), _load(0, 2, kv=10)]) == 1
    assert coordinator.choose_rank([_load(0, 2, kv=10), _load(1, 1, kv=10), _load(0, 0, kv=50)]) == 2
    assert DPCoordinator(num_ranks=2, max_num_seqs=8).choose_rank([_load(), _load()]) == 0


def test_bubble_threshold_in_blocks_and_as_ratio() -> None:
    loads = [_load(kv=100), _load(kv=60), _load(kv=20)]  # mean 60
    assert exceeds_bubble(loads, 0, 39.0) and not exceeds_bubble(loads, 0, 40.0)
    assert not exceeds_bubble(loads, 1, 1.0)
    # Ratio form: (100 - 60) / 100 = 0.4.
    assert exceeds_bubble(loads, 0, 0.39) and not exceeds_bubble(loads, 0, 0.4)
    assert not exceeds_bubble([_load(), _load()], 0, 0.1)  # idle ranks never exceed


def test_bubble_gate_holds_back_the_overloaded_rank() -> None:
    gated = DPCoordinator(num_ranks=2, max_num_seqs=8, dyntra_lb_config=DyntraLBConfig(enabled=True,
                                                                                        bubble_threshold=8.0))
    # Rank 0 has fewer requests but far more KV: the plain router picks it, the gate does not.
    loads = [_load(0, 1, kv=40), _load(1, 2, kv=10)]
    assert DPCoordinator(num_ranks=2, max_num_seqs=8).choose_rank(loads) == 0
    assert gated.admissible_ranks(loads) == [1]
    assert gated.choose_rank(loads) == 1
    assert gated.admissible_ranks([_load(0, 1, kv=20), _load(1, 2, kv=10)]) == [0, 1]  # 5 blocks over the mean


def test_balance_scheduling_gate_is_global() -> None:
    coordinator = DPCoordinator(num_ranks=2, max_num_seqs=4, enable_balance_scheduling=True)
    assert coordinator.choose_rank([_load(0, 4), _load(0, 0)]) is None  # one rank full: nobody admits
    assert coordinator.choose_rank([_load(0, 3), _load(0, 1)]) == 1


def test_dp2_greedy_equals_single_engine_and_spreads_requests(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(8, 600) for _ in range(rng.randint(3, 60))]} for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(folder, max_model_len=256, num_kv_blocks=64)
                 .generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, max_model_len=256, num_kv_blocks=64, data_parallel_size=2,
              dyntra_lb_config={"enabled": True, "bubble_threshold": 4})
    core = llm.llm_engine.engine_core
    assert isinstance(core, DataParallelEngineCore) and len(core.cores) == 2
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert core.requests_routed_per_rank == [3, 3]
    assert core.tokens_served_per_rank == [36, 36]
    assert len(core.make_stats_per_rank()) == 2 and core.make_stats().num_running_requests == 0
    assert not core.has_unfinished_requests() and not core.owner
