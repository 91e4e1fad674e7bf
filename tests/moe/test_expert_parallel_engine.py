"""Expert parallel end to end: the 'mp' executor with two gloo ranks (TP=2, experts partitioned over the
EP group, two redundant EPLB slots) greedy-equals the single-process engine, with FlashLB rebalances
forced every 3 steps mid-generation."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams


def _generate(folder: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], object]:
    llm = LLM(folder, dtype="float32", max_model_len=128, num_kv_blocks=64, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.make_stats()
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], stats


def test_expert_parallel_two_ranks_with_eplb_equals_single_process(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3-moe", num_hidden_layers=3)
    prompts = [[(7 * i + 3 * j) % 600 + 8 for j in range(n)] for i, n in enumerate((6, 19, 33))]
    expected, _ = _generate(folder, prompts)
    actual, stats = _generate(
        folder, prompts, tensor_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="mp",
        num_cpu_threads=1,
        eplb_config={"enable": True, "step_interval": 3, "num_redundant_experts": 2, "window_size": 6,
                     "policy": "flashlb"})
    assert actual == expected
    assert stats.eplb_num_rebalances >= 4
    assert len(stats.eplb_imbalance_before) == len(stats.eplb_imbalance_after) == 3
    # Two ranks, redundant replicas of hot experts: FlashLB never leaves a layer worse than it found it.
    assert all(after <= before + 1e-9 for before, after in zip(stats.eplb_imbalance_before,
                                                               stats.eplb_imbalance_after))
