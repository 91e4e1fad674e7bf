"""The native decode stack's one parallel region against the same stack op by op, in one process (issue #7).

Loads the SmolLM2-135M-shaped benchmark model once, then makes two native plan objects over the same weights and
KV caches: one with `one_region_max_rows` = ONE_REGION_MAX_ROWS (decode steps run every layer in one OpenMP region)
and one with 0 (each op starts and joins its own team). Rounds alternate which goes first; each times `--num-prompts`
greedy requests of `--max-tokens` tokens (best of two) minus a one-token run, and prints decode tokens/s per variant,
the per-round ratio and its median, and whether both produced the same tokens. This VM's speed moves between
processes by more than the difference measured here, so only alternating rounds in one process resolve it.

    python benchmarks/decode_stack_region.py --dtype bfloat16 --rounds 6 [--num-prompts 1] [--max-tokens 256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
import native_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time

    from pagedserve import LLM, SamplingParams
    from pagedserve.attention.cpu_native import DECODE_PARTITION_TOKENS
    from pagedserve.kernels import elementwise as native_elementwise
    from pagedserve.models.native_decode_stack import ONE_REGION_MAX_ROWS, NativeDecodeForward

    torch.set_num_threads(args.threads)
    llm = LLM(benchmark_model_folder(), dtype=args.dtype, max_model_len=1024, num_kv_blocks=256 * args.num_prompts,
              huge_page_weights=True)
    prompts = [{"prompt_token_ids": [100 + (7 * i + 13 * j) % 30000 for i in range(128)]}
               for j in range(args.num_prompts)]

    def run(max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [output.outputs[0].token_ids for output in outputs]

    run(8)  # the plan's native object is made at the first decode step
    forward = llm.llm_engine.engine_core.executor.worker.model_runner.forward
    if not isinstance(forward, NativeDecodeForward):
        raise SystemExit("the native decode stack is not used for this model here")
    plan = forward.plan
    kv_caches = [layer.kv_cache for layer in plan.attention_layers]

    def make(one_region_max_rows: int):
        return torch.classes.pagedserve.DecodeStackPlan(
            list(plan.weights), list(plan.biases), kv_caches, plan.embedding, plan.final_norm, plan.cos_sin_cache,
            list(plan.output_sizes), list(plan.sliding_windows), plan.num_heads, plan.num_kv_heads, plan.head_dim,
            plan.eps, plan.scale, plan.linear_kind, native_elementwise.REDUCTION_LANES, DECODE_PARTITION_TOKENS,
            one_region_max_rows)

    variants = {"one_region": make(ONE_REGION_MAX_ROWS), "op_by_op": make(0)}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(args.rounds):
        order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
        for name in order:
            plan.native = variants[name]
            one = min(run(1)[0] for _ in range(2))
            fulls = [run(args.max_tokens) for _ in range(2)]
            tokens.setdefault(name, fulls[0][1])
            decoded = (args.max_tokens - 1) * args.num_prompts
            rates[name].append(decoded / (min(seconds for seconds, _ in fulls) - one))
        print(f"round {round_index}: one region {rates['one_region'][-1]:.1f} tok/s, op by op "
              f"{rates['op_by_op'][-1]:.1f} tok/s, ratio {rates['one_region'][-1] / rates['op_by_op'][-1]:.3f}",
              flush=True)
    ratios = [a / b for a, b in zip(rates["one_region"], rates["op_by_op"])]
    print(f"median ratio one region / op by op: {statistics.median(ratios):.3f} "
          f"({args.dtype}, {args.num_prompts} rows, {args.rounds} rounds); one region steps: "
          f"{variants['one_region'].num_one_region_steps()}; same tokens: {tokens['one_region'] == tokens['op_by_op']}")


if __name__ == "__main__":
    main()
