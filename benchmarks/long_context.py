"""Long context on the CPU: one prompt of `--context` tokens on the tests' tiny DeepSeek-V3.2 model (DSA, index_topk
2048, float32) with chunked prefill (2,048-token chunks), then 16 greedy tokens.

    PYTHONPATH=. python benchmarks/long_context.py [--context 32768] [--output-len 16] [--num-cpu-threads N]

Prints the time to the first token, the decode time per token, the process's peak resident memory and the CPU
seconds of the request (prefill and decode; steadier than the wall times on a machine shared with other jobs).
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedserve import LLM, SamplingParams  # noqa: E402
import native_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-cpu-threads", type=int, default=None,
                        help="torch threads (default: all cores); 1 keeps a run on a shared, loaded machine steady")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    from tiny_models import build_tiny_model

    folder = build_tiny_model("deepseek-v32", tempfile.mkdtemp(prefix="pagedserve-long-context-"),
                              max_position_embeddings=args.context + args.output_len + 64, index_topk=2048)
    llm = LLM(folder, dtype="float32", max_model_len=args.context + args.output_len, max_num_batched_tokens=2048,
              enable_prefix_caching=False, max_num_seqs=1, num_cpu_threads=args.num_cpu_threads)
    rng = random.Random(0)
    prompt = [rng.randrange(8, 600) for _ in range(args.context)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    cpu_start = time.process_time()
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    # Process CPU seconds (the engine runs in this process): steadier than wall time on a loaded machine.
    cpu_seconds = time.process_time() - cpu_start
    metrics = output.metrics
    first = metrics["first_token_time"] - metrics["arrival_time"]
    per_token = (metrics["last_token_time"] - metrics["first_token_time"]) / max(args.output_len - 1, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"context {args.context}: {len(output.outputs[0].token_ids)} tokens, TTFT {first:.1f} s, "
          f"decode {per_token * 1e3:.0f} ms/token, peak RSS {peak:.2f} GiB, CPU {cpu_seconds:.1f} s")


if __name__ == "__main__":
    main()
