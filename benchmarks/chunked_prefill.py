"""Chunked prefill vs decode latency: TPOT of 16 running decodes while a 3,500-token prompt arrives.

Three engines on the same workload (random Llama of SmolLM2-135M's shape, bf16 by default):
  no-chunk  enable_chunked_prefill=False, max_num_batched_tokens=4096: the prompt is one step;
  fixed     1024-token chunks (long_prefill_token_threshold=1024, budget 1024 + 16 decodes);
  tuned     profiling_chunk_config: start-up latency fit, chunks sized to fit --target-tpot-ms.
Per engine: 16 requests (64-token prompts) are brought to steady decoding, 10 decode steps are timed
(baseline TPOT), then the long prompt is added and every step is timed until it emits its first token.
Reported: the decodes' mean TPOT and worst inter-token gap over that window, and the long prompt's TTFT.

    python benchmarks/chunked_prefill.py [--dtype bfloat16] [--target-tpot-ms 150] [--json out.json]

The result goes to results/chunked_prefill_<dtype>_<cpu kind>.json (cpu_kind.py) unless --json names another file.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import SMOLLM2_SHAPE, benchmark_model_folder  # noqa: E402
from cpu_kind import result_path  # noqa: E402
import native_guard  # noqa: E402

NUM_DECODES = 16
LONG_PROMPT_TOKENS = 3500


def run(folder: str, dtype: str, label: str, **engine_kwargs) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine.from_kwargs(folder, dtype=dtype, max_model_len=4096, num_kv_blocks=1024,
                                   enable_prefix_caching=False, **engine_kwargs)
    start_s = time.perf_counter() - start
    rng = random.Random(0)
    vocab = SMOLLM2_SHAPE["vocab_size"]
    decode_params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True, detokenize=False)
    for index in range(NUM_DECODES):
        engine.add_request(f"decode-{index}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(64)]},
                           decode_params)
    for _ in range(5):  # prefill the 16 prompts and settle into decoding
        engine.step()
    baseline = []
    for _ in range(10):
        step_start = time.perf_counter()
        engine.step()
        baseline.append(time.perf_counter() - step_start)

    long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    engine.add_request("long", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(LONG_PROMPT_TOKENS)]},
                       long_params)
    arrival = time.perf_counter()
    step_times: list[float] = []
    decode_tokens = 0
    chunks: list[int] = []
    scheduler = engine.engine_core.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        if "long" in output.num_scheduled_tokens:
            chunks.append(output.num_scheduled_tokens["long"])
        return output

    scheduler.schedule = recording_schedule
    ttft = None
    while ttft is None:
        step_start = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - step_start)
        for output in outputs:
            if output.request_id == "long" and output.outputs[0].token_ids:
                ttft = time.perf_counter() - arrival
            elif output.request_id.startswith("decode-"):
                decode_tokens += 1
    window = sum(step_times)
    engine.abort_request([f"decode-{index}" for index in range(NUM_DECODES)])
    engine.shutdown()
    return dict(
        engine=label, start_s=round(start_s, 2),
        baseline_tpot_ms=round(1000 * sum(baseline) / len(baseline), 1),
        window_tpot_ms=round(1000 * window / max(decode_tokens / NUM_DECODES, 1), 1),
        max_gap_ms=round(1000 * max(step_times), 1),
        long_ttft_s=round(ttft, 2), num_steps=len(step_times), chunks=chunks,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--target-tpot-ms", type=float, default=150.0)
    parser.add_argument("--json", default=None,
                        help="result file (default: results/chunked_prefill_<dtype>_<cpu kind>.json; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.json is None:
        args.json = result_path("chunked_prefill", args.dtype)
    folder = benchmark_model_folder()
    results = [
        run(folder, args.dtype, "no-chunk", enable_chunked_prefill=False, max_num_batched_tokens=4096),
        run(folder, args.dtype, "fixed-1024", max_num_batched_tokens=1024 + NUM_DECODES,
            long_prefill_token_threshold=1024),
        run(folder, args.dtype, f"tuned-{args.target_tpot_ms:g}ms", max_num_batched_tokens=4096,
            profiling_chunk_config={"enable": True, "target_tpot_ms": args.target_tpot_ms,
                                    "chunk_sizes": [16, 64, 256, 512, 1024, 2048], "history_sizes": [1024, 2048]}),
    ]
    print(f"{'engine':<16} {'base TPOT ms':>12} {'TPOT ms':>9} {'max gap ms':>10} {'long TTFT s':>11} "
          f"{'steps':>5}  chunks")
    for r in results:
        print(f"{r['engine']:<16} {r['baseline_tpot_ms']:>12} {r['window_tpot_ms']:>9} {r['max_gap_ms']:>10} "
              f"{r['long_ttft_s']:>11} {r['num_steps']:>5}  {r['chunks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"native_kernels": native_kernels, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
