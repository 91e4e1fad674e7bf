"""`pagedserve bench pd`: the P/D split to run for a workload.

It measures one engine's prefill and decode capacity for the workload in this process (pd_capacity.py), applies
the TTFT / TPOT SLOs and prints the arithmetic and the recommended xPyD for N instances (pd_split.py). With
--sweep it then runs real splits, and N colocated engines, behind `pagedserve proxy` on this host and reports
their goodput (pd_sweep.py).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any


def engine_kwargs_from_serve_args(model: str | None, serve_args: list[str]) -> dict[str, Any]:
    """The LLMEngine kwargs that `pagedserve serve --model MODEL SERVE_ARGS` would use."""
    from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser(prog="--serve-args", add_help=False)
    add_engine_args(parser)
    return engine_kwargs_from_args(parser.parse_args(["--model", model, *serve_args] if model else serve_args))


def measure(args: argparse.Namespace, serve_args: list[str]) -> dict[str, Any]:
    """Measure one engine, print the arithmetic; returns the figures (for --result-file)."""
    from pagedserve.bench.pd_capacity import measure_capacity
    from pagedserve.bench.pd_split import decode_rate, explain, prefill_rate, recommend_split
    from pagedserve.engine.llm_engine import LLMEngine

    engine_kwargs = engine_kwargs_from_serve_args(args.model, serve_args)
    engine = LLMEngine.from_kwargs(**engine_kwargs)
    try:
        core = engine.engine_core
        kv_tokens = core.runtime_info.num_kv_blocks * engine.config.tokens_per_block
        mean_prompt = (args.input_len_range[0] + args.input_len_range[1]) / 2
        per_request = mean_prompt + args.num_decode_steps + 6
        # Larger batches would wait for seats or KV room (a smaller real batch): leave them out, and say so.
        batch_sizes = [size for size in args.batch_sizes
                       if size <= engine.config.scheduler_config.max_num_seqs and size * per_request <= kv_tokens]
        dropped = sorted(set(args.batch_sizes) - set(batch_sizes))
        if dropped:
            print(f"batch sizes {dropped} left out: over max_num_seqs or the KV cache ({kv_tokens} tokens)")
        capacity = measure_capacity(engine, tuple(args.input_len_range), batch_sizes,
                                    num_prefill_prompts=args.num_prefill_prompts,
                                    num_decode_steps=args.num_decode_steps, seed=args.seed,
                                    vocab_range=tuple(args.vocab_range))
    finally:
        engine.shutdown()
    mean_output = (args.output_len_range[0] + args.output_len_range[1]) / 2
    ttft_slo, tpot_slo = args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000
    first_step = capacity.step_seconds[min(capacity.step_seconds)]
    prefill = prefill_rate(capacity.mean_prefill_seconds, ttft_slo, first_step)
    decode = decode_rate(capacity.step_seconds, mean_output, tpot_slo, max_batch_size=max(capacity.step_seconds))
    print(f"workload: prompts U{list(args.input_len_range)} tokens, outputs U{list(args.output_len_range)} tokens; "
          f"SLOs: TTFT {args.ttft_slo_ms:.0f} ms, TPOT {args.tpot_slo_ms:.0f} ms")
    print(f"prefill, one prompt at a time: {capacity.prefill_tokens_per_second:.0f} prompt tokens/s, "
          f"{capacity.mean_prefill_seconds * 1000:.1f} ms per prompt on average "
          f"({min(capacity.prefill_seconds) * 1000:.1f} .. {max(capacity.prefill_seconds) * 1000:.1f} ms)")
    print("decode step t(B): " + ", ".join(f"B={size}: {seconds * 1000:.1f} ms ({size / seconds:.0f} tok/s)"
                                            for size, seconds in sorted(capacity.step_seconds.items())))
    print(explain(prefill, decode, args.num_instances, ttft_slo, tpot_slo, mean_output, first_step))
    if decode.batch_size == max(capacity.step_seconds):
        print(f"(B = {decode.batch_size} is the largest batch measured: a larger one may meet the TPOT SLO too, so "
              f"the D rate is a floor; add --batch-sizes)")
    best = recommend_split(prefill, decode, args.num_instances)
    return {"prefill_seconds": capacity.prefill_seconds, "prefill_prompt_lens": capacity.prefill_prompt_lens,
            "step_seconds": capacity.step_seconds, "prefill_requests_per_second": prefill.requests_per_second,
            "decode_requests_per_second": decode.requests_per_second, "decode_batch_size": decode.batch_size,
            "recommended": best.name, "recommended_requests_per_second": best.requests_per_second}


def run_bench_pd(args: argparse.Namespace) -> int:
    """The `pagedserve bench pd` handler."""
    if args.num_instances < 2:
        raise ValueError(f"num_instances={args.num_instances} must be >= 2 (one P and one D at least)")
    serve_args = shlex.split(args.serve_args)
    result: dict[str, Any] = {"config": {key: value for key, value in vars(args).items() if key != "handler"}}
    if not args.skip_measure:
        result["measurement"] = measure(args, serve_args)
    if args.sweep:
        from pagedserve.bench.pd_sweep import SWEEP_HEADER, format_sweep_row, run_layout, sweep_layouts
        from pagedserve.bench.serve import make_requests

        if args.model is None:
            raise ValueError("--sweep needs --model (the servers load it)")
        import signal

        # SIGTERM unwinds like Ctrl-C, so run_layout's finally stops the servers it started.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
        slos = {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms}
        requests = make_requests(args.num_prompts, "random", None, tuple(args.input_len_range),
                                 tuple(args.output_len_range), tuple(args.vocab_range), args.seed)
        print(f"\nsweep: {args.num_prompts} requests at Poisson {args.request_rate} req/s through the proxy, "
              f"goodput within TTFT {args.ttft_slo_ms:.0f} ms and TPOT {args.tpot_slo_ms:.0f} ms")
        print(SWEEP_HEADER, flush=True)
        result["sweep"] = {}
        for layout in sweep_layouts(args.num_instances, args.splits):
            summary = run_layout(layout, args.model, serve_args, requests, request_rate=args.request_rate,
                                 slos=slos, seed=args.seed)
            result["sweep"][layout.name] = {key: value for key, value in summary.items() if key != "errors"} | {
                "errors": summary["errors"]}
            print(format_sweep_row(layout, summary), flush=True)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
