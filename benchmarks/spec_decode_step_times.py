"""Where a speculative step's time goes: timers around the model runner's calls while the default model generates
the copy-heavy workload one prompt at a time with ngram speculation (issue #29).

Reported per kind of call: count, total and mean milliseconds. `forward[N]` is a target forward over N tokens
(N = K + 1: a verification; larger: a prefill), `greedy_decode` a plain decode step on the native stack (LM head
and argmax included), `verify` the verification after the forward (LM head over the scored positions and the
greedy rule or the rejection sampler), `greedy_targets[N]` a plain greedy verification of N tokens on the native
decode stack (the layers and the LM head's argmax in one call) and `verify_targets` its greedy rule, `propose` the
next drafts. A benchmark, not a test: numbers move with the
machine.

    python benchmarks/spec_decode_step_times.py [--num-prompts 4] [--num-speculative-tokens 4]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import WORKLOAD, load_prompts  # noqa: E402
import native_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pagedserve import LLM, SamplingParams

    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()

    def timed(owner: Any, name: str, key: Callable[[tuple[Any, ...]], str]) -> None:
        call = getattr(owner, name)

        def wrapper(*call_args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = call(*call_args, **kwargs)
            totals[key(call_args)] += time.perf_counter() - start
            counts[key(call_args)] += 1
            return result

        setattr(owner, name, wrapper)

    timed(runner, "forward", lambda call_args: f"forward[{call_args[0].shape[0]}]")
    if runner.greedy_decode is not None:
        timed(runner, "greedy_decode", lambda call_args: "greedy_decode")
    timed(runner.speculator, "verify", lambda call_args: "verify")
    if runner.greedy_targets is not None:
        timed(runner, "greedy_targets", lambda call_args: f"greedy_targets[{call_args[0].shape[0]}]")
        timed(runner.speculator, "verify_targets", lambda call_args: "verify_targets")
    timed(runner.speculator, "propose", lambda call_args: "propose")
    with open(WORKLOAD) as handle:
        prompts = load_prompts(llm, json.load(handle))[:args.num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=160, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    totals.clear()
    counts.clear()
    start = time.perf_counter()
    num_tokens = sum(len(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
                     for p in prompts)
    elapsed = time.perf_counter() - start
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tok/s")
    for key in sorted(totals, key=lambda k: -totals[k]):
        print(f"{key:16s} n={counts[key]:4d} total={totals[key] * 1000:8.1f} ms mean={totals[key] / counts[key] * 1000:7.2f} ms")


if __name__ == "__main__":
    main()
