"""Pipeline parallel: output tokens/s of PP=2 with one micro-batch per stage in flight vs one step at a time,
next to a single process, on the benchmark model (30 layers: 15 per stage).

    python benchmarks/pipeline_parallel.py [--requests 16] [--output-len 64] [--model benchmark|tiny]
                                           [--max-num-batched-tokens 256]

"one at a time" forces the multiprocess executor's max_concurrent_batches to 1 (no batch queue): stage 0
idles while stage 1 runs and vice versa. With the batch queue (max_concurrent_batches = 2) the engine
submits the next step while the previous one is still in the pipeline — but a request is in one step at
a time, so two steps can be in flight only when the running requests fall into different batches (a
token budget below the total prompt length splits the prefills, and the groups persist). All variants run in this process
one after the other (timings on shared cores are noisy: read the ratios). On 2 cores each PP worker runs
1 thread while the single process runs 2, so PP is not expected to beat it here.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.executor.multiproc import MultiprocExecutor  # noqa: E402
import native_guard  # noqa: E402


def model_folder(kind: str) -> str:
    if kind == "tiny":
        from tiny_models import build_tiny_model

        return build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedserve-pp-bench-"), num_hidden_layers=8,
                                hidden_size=256, intermediate_size=1024)
    from benchmark_model import benchmark_model_folder

    return benchmark_model_folder()


def measure(folder: str, prompts: list[list[int]], output_len: int, max_num_batched_tokens: int,
            **kwargs: object) -> tuple[float, int, int]:
    """(seconds, output tokens, most steps seen in flight) of one generate() over `prompts`."""
    llm = LLM(folder, max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=max_num_batched_tokens,
              **kwargs)
    try:
        engine_core = llm.llm_engine.engine_core
        most_in_flight = [1]
        queue = engine_core.batch_queue
        if queue is not None:
            submit = queue.submit

            def recording_submit(*args: object, **kw: object):  # type: ignore[no-untyped-def]
                step = submit(*args, **kw)
                most_in_flight[0] = max(most_in_flight[0], len(queue))
                return step

            queue.submit = recording_submit  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), most_in_flight[0]
    finally:
        llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model", choices=("benchmark", "tiny"), default="benchmark")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    folder = model_folder(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000 if args.model == "benchmark" else 500) for _ in range(rng.randint(32, 128))]
               for _ in range(args.requests)]

    budget = args.max_num_batched_tokens
    results = {"1 process": measure(folder, prompts, args.output_len, budget)}
    original = MultiprocExecutor.max_concurrent_batches
    MultiprocExecutor.max_concurrent_batches = property(lambda self: 1)  # type: ignore[assignment]
    try:
        results["PP=2, one step at a time"] = measure(folder, prompts, args.output_len, budget,
                                                      pipeline_parallel_size=2)
    finally:
        MultiprocExecutor.max_concurrent_batches = original  # type: ignore[assignment]
    results["PP=2, 2 micro-batches in flight"] = measure(folder, prompts, args.output_len, budget,
                                                         pipeline_parallel_size=2)

    print(f"{args.requests} requests x {args.output_len} output tokens, model={args.model}, "
          f"max_num_batched_tokens={budget}")
    for name, (seconds, num_tokens, most_in_flight) in results.items():
        print(f"  {name:34s} {seconds:7.2f} s  {num_tokens / seconds:8.1f} tok/s  (max in flight {most_in_flight})")
    serial = results["PP=2, one step at a time"][0]
    overlapped = results["PP=2, 2 micro-batches in flight"][0]
    print(f"  micro-batch overlap speed-up: {serial / overlapped:.2f}x")


if __name__ == "__main__":
    main()
