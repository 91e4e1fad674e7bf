"""The `pagedserve` command: generate | chat | serve | proxy | bench serve | bench pd | features | quantize."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import sys
from typing import Iterator

from pagedserve.config.cli_args import (add_engine_args, add_sampling_args, engine_kwargs_from_args,
                                        sampling_params_from_args)


@contextlib.contextmanager
def _start_up() -> Iterator[None]:
    """The imports and the engine's construction of a command that builds one engine and exits (chat, generate).

    They make millions of objects that live until exit, and little garbage (a few MB of cycles): the cyclic
    collector stays paused meanwhile instead of walking the growing heap again and again, and what they made is
    then frozen (gc.freeze) so that no later collection walks it again, the ones at interpreter exit included.
    About 1 s of a warm `pagedserve chat` start on a 2-core machine (benchmarks/chat_startup.py)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def _cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or [sys.stdin.read()]
    params = sampling_params_from_args(args)
    with _start_up():
        from pagedserve.llm import LLM

        llm = LLM(**engine_kwargs_from_args(args))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        if args.json:
            print(json.dumps({
                "prompt": output.prompt,
                "prompt_token_ids": output.prompt_token_ids,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                             "cumulative_logprob": c.cumulative_logprob} for c in output.outputs],
            }))
        else:
            for completion in output.outputs:
                print(completion.text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    with _start_up():
        from pagedserve.chat import run_chat
        from pagedserve.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_kwargs(**engine_kwargs_from_args(args))
    try:
        return run_chat(engine, sampling_params_from_args(args), args.system)
    finally:
        engine.shutdown()


def _cmd_features(args: argparse.Namespace) -> int:
    from pagedserve.features import FEATURES, render_markdown

    if args.markdown:
        print(render_markdown(), end="")
        return 0
    from pagedserve.kernels import cpu_isa

    print(f"native CPU kernels: ISA level {cpu_isa.describe()}"
          + (f"; {cpu_isa.reason_for_no_build()}" if cpu_isa.reason_for_no_build() else ""))
    width = max(len(f.feature) for f in FEATURES)
    for feature in FEATURES:
        print(f"{feature.line:<9} {feature.family:<16} {feature.feature:<{width}}  "
              f"knobs: {', '.join(feature.knobs) or '-'}")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from pagedserve.quantization.quantize_checkpoint import quantize_checkpoint

    summary = quantize_checkpoint(args.model, args.out, scheme=args.scheme, calibration=args.calibration,
                                  static=args.static, smoothquant_alpha=args.smoothquant_alpha, ignore=args.ignore)
    activations = (f"static per-tensor activation scales from {summary.num_calibration_tokens} calibration tokens"
                   if summary.is_static else "dynamic per-token activations")
    smoothing = (f", {summary.num_smoothed} SmoothQuant mappings from {summary.num_calibration_tokens} calibration "
                 f"tokens" if summary.num_smoothed else "")
    ignored = f", {summary.num_ignored} linear layers kept by --ignore" if summary.num_ignored else ""
    print(f"wrote {summary.out}: {summary.num_quantized} linear layers int8 ({activations}){smoothing}{ignored}, "
          f"{summary.num_kept} tensors kept as they were")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.launcher import run_serve

    return run_serve(args)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from pagedserve.proxy.pd_proxy import run_proxy

    return run_proxy(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve import run_bench_serve

    return run_bench_serve(args)


def _cmd_bench_pd(args: argparse.Namespace) -> int:
    from pagedserve.bench.pd import run_bench_pd

    return run_bench_pd(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts offline")
    generate.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    generate.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(handler=_cmd_generate)

    chat = commands.add_parser("chat", help="chat in the terminal (stdin as one message when not a TTY)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, default_max_tokens=512)
    chat.set_defaults(handler=_cmd_chat)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    from pagedserve.server.serve_args import add_serve_args

    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(handler=_cmd_serve)

    proxy = commands.add_parser("proxy", help="an OpenAI-compatible front over prefill and decode servers "
                                              "(prefill/decode disaggregation)")
    from pagedserve.proxy.proxy_args import add_proxy_args

    add_proxy_args(proxy)
    proxy.set_defaults(handler=_cmd_proxy)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_commands.add_parser("serve", help="load-test an OpenAI-compatible /v1/completions server")
    from pagedserve.bench.serve_args import add_bench_serve_args

    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(handler=_cmd_bench_serve)
    bench_pd = bench_commands.add_parser("pd", help="measure prefill and decode capacity for a workload and "
                                                     "recommend the xPyD split (--sweep: run real splits)")
    from pagedserve.bench.pd_args import add_bench_pd_args

    add_bench_pd_args(bench_pd)
    bench_pd.set_defaults(handler=_cmd_bench_pd)

    quantize = commands.add_parser("quantize", help="write a W8A8 int8 compressed-tensors checkpoint of an HF folder")
    quantize.add_argument("--model", required=True, help="HF model folder (config.json + *.safetensors)")
    quantize.add_argument("--out", required=True, help="new output folder")
    quantize.add_argument("--scheme", default="w8a8", help="quantization scheme (w8a8: int8 weights per channel, "
                                                          "int8 activations)")
    quantize.add_argument("--static", action="store_true",
                          help="static per-tensor activation scales from --calibration (default: dynamic per token)")
    quantize.add_argument("--calibration", default=None,
                          help="UTF-8 text file the float model runs over (--static, --smoothquant-alpha)")
    quantize.add_argument("--smoothquant-alpha", type=float, default=None,
                          help="SmoothQuant smoothing strength in [0, 1] (needs --calibration): per-channel factors "
                               "folded into the norms and linears before rounding (default: no smoothing)")
    quantize.add_argument("--ignore", action="append", default=[], metavar="MODULE",
                          help="keep this linear module unquantized (HF module name or 're:' regex; repeatable), "
                               "listed in quantization_config.ignore")
    quantize.set_defaults(handler=_cmd_quantize)

    features = commands.add_parser("features", help="list the features this build implements")
    features.add_argument("--markdown", action="store_true", help="print docs/features.md")
    features.set_defaults(handler=_cmd_features)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
