"""MoE + MLA under tensor parallelism without EP (experts replicated per rank): greedy equal to TP=1."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams


def test_deepseek_v2_tp2_equals_single_process(tiny_model_dir) -> None:
    folder = tiny_model_dir("deepseek-v2")
    prompts = [{"prompt_token_ids": [10, 20, 30, 40, 50, 60, 70]}, {"prompt_token_ids": list(range(100, 140))}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    single = LLM(folder, max_model_len=256, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    sharded_llm = LLM(folder, max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        sharded = sharded_llm.generate(prompts, params, use_tqdm=False)
    finally:
        sharded_llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]
