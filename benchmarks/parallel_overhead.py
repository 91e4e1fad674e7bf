"""Parallel overhead: per-step time of TP=2 vs TP=1 on the benchmark model, and DP=2 tokens per rank
under a skewed arrival pattern with and without the DyntraLB-style bubble gate.

    python benchmarks/parallel_overhead.py [--steps 40] [--skip-tp]

On a 2-core CPU speed-up is not the point: TP=2 runs two 1-thread workers against one 2-thread
process, so the difference mostly shows the per-step cost of the collectives plus the pipe round trip.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_model import benchmark_model_folder  # noqa: E402
import native_guard  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402


def decode_step_ms(folder: str, steps: int, **kwargs: object) -> float:
    """Median wall time of a decode step of 8 requests (after their prefill)."""
    engine = LLMEngine.from_kwargs(folder, max_model_len=512, num_kv_blocks=256, **kwargs)
    try:
        rng = random.Random(0)
        for index in range(8):
            engine.add_request(str(index), {"prompt_token_ids": [rng.randrange(8, 600) for _ in range(32)]},
                               SamplingParams(temperature=0.0, max_tokens=steps + 5, ignore_eos=True))
        engine.step()  # prefill
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1000
    finally:
        engine.shutdown()


def skewed_dp_run(folder: str, gate: bool) -> list[int]:
    """DP=2: long requests arrive first, then a stream of short ones; tokens served per rank."""
    kwargs: dict = dict(data_parallel_size=2, max_model_len=512, num_kv_blocks=128, max_num_seqs=8)
    if gate:
        kwargs["dyntra_lb_config"] = {"enabled": True, "bubble_threshold": 4}
    engine = LLMEngine.from_kwargs(folder, **kwargs)
    try:
        rng = random.Random(1)
        arrivals = [(0, 300, 40)] * 2 + [(step, 16, 8) for step in range(2, 40, 2) for _ in range(2)]
        step, index = 0, 0
        while index < len(arrivals) or engine.has_unfinished_requests():
            while index < len(arrivals) and arrivals[index][0] <= step:
                _, prompt_len, max_tokens = arrivals[index]
                engine.add_request(str(index), {"prompt_token_ids": [rng.randrange(100, 40000)
                                                                     for _ in range(prompt_len)]},
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                index += 1
            engine.step()
            step += 1
        return list(engine.engine_core.tokens_served_per_rank)
    finally:
        engine.shutdown()


def tp_model_folder() -> str:
    """SmolLM2-135M's hidden sizes and depth with 8 query / 2 KV heads (its 9 / 3 heads do not split in
    two; TP=3 would not fit 2 cores). Vocabulary: the tiny test tokenizer's."""
    folder = os.path.join(os.path.dirname(benchmark_model_folder()), "smollm2-shape-8-heads")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from tiny_models import build_tiny_model

        build_tiny_model("llama", folder, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip-tp", action="store_true")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    folder = benchmark_model_folder()
    if not args.skip_tp:
        tp_folder = tp_model_folder()
        tp1 = decode_step_ms(tp_folder, args.steps)
        tp2 = decode_step_ms(tp_folder, args.steps, tensor_parallel_size=2)
        print(f"decode step (8 requests): TP=1 {tp1:.1f} ms, TP=2 {tp2:.1f} ms, difference {tp2 - tp1:+.1f} ms")
    for gate in (False, True):
        print(f"DP=2 skewed arrivals, bubble gate {'on ' if gate else 'off'}: tokens per rank "
              f"{skewed_dp_run(folder, gate)}")


if __name__ == "__main__":
    main()
