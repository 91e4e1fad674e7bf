"""Structured outputs (issue #33): grammar compile time for the schema suite, and recipe A's throughput with every
request under a JSON schema against the same workload unconstrained.

Compile: each schema of tests/structured_output/schema_suite.py compiled by a fresh GrammarCompiler (cold; the
tokenizer's xgrammar TokenizerInfo is built once before and timed apart), then again (cached).
Throughput: recipe A's workload (benchmarks/offline_throughput.py make_workload: prompts U[64, 512] random token
ids, outputs U[64, 256], ignore_eos, greedy, seed 0; `--temperature` samples instead, seeded) on the default model (SmolLM2-135M-Instruct GGUF: structured
outputs need its tokenizer). Constrained, every request carries SCHEMA below, which no output of these lengths can
complete, so every token is generated under the grammar (`constrained_fraction`, the share of tokens before a stop
token, checks it). The two variants are timed in
alternating order, `--rounds` times each; the best run of each and their ratio are reported.

    python benchmarks/structured_outputs.py --num-requests 8 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "structured_output"))
from offline_throughput import make_workload  # noqa: E402
from schema_suite import SCHEMA_SUITE  # noqa: E402

# At least 100 strings of 8+ characters: no output of recipe A's lengths (<= 256 tokens) can close it, so every
# token of every request is generated under the grammar.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 100, "items": {
    "type": "string", "minLength": 8, "maxLength": 24}}}, "required": ["notes"]}


def compile_times() -> dict[str, object]:
    from pagedserve.model_loader.model_source import open_model_source
    from pagedserve.model_loader.default_model import resolve_model_path
    from pagedserve.structured_output.grammar_compiler import GrammarCompiler
    from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

    source = open_model_source(resolve_model_path(None))
    tokenizer = source.load_tokenizer(None)
    stops = sorted(source.eos_token_ids(tokenizer))
    compiler = GrammarCompiler(lambda: (tokenizer, stops), len(tokenizer), cache_size=64)
    start = time.perf_counter()
    compiler._backend()  # TokenizerInfo: once per engine
    tokenizer_info_s = time.perf_counter() - start
    cold, cached = {}, {}
    for name, schema in SCHEMA_SUITE.items():
        key = StructuredOutputsParams(json=schema).cache_key
        start = time.perf_counter()
        compiler.compile(key)
        cold[name] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiler.compile(key)
        cached[name] = (time.perf_counter() - start) * 1e3
    return {"tokenizer_info_ms": tokenizer_info_s * 1e3, "cold_ms": cold, "cached_ms": cached,
            "cold_total_ms": sum(cold.values()), "cached_total_ms": sum(cached.values())}


def throughput(num_requests: int, rounds: int, seed: int, temperature: float) -> dict[str, object]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

    llm = LLM(max_model_len=1024, seed=seed)
    vocab_size = llm.config.model_config.vocab_size
    workload = make_workload(num_requests, seed, vocab_size, (64, 512), (64, 256))
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    constraint = StructuredOutputsParams(json=SCHEMA)
    variants = {
        "unconstrained": [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=n, ignore_eos=True)
                          for i, (_, n) in enumerate(workload)],
        "json_schema": [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=n, ignore_eos=True,
                                       structured_outputs=constraint) for i, (_, n) in enumerate(workload)],
    }
    llm.generate(prompts[:2], variants["json_schema"][:2], use_tqdm=False)  # warm-up: tokenizer, compile, kernels
    runs: dict[str, list[float]] = {name: [] for name in variants}
    constrained_fraction = None
    num_tokens = sum(n for _, n in workload)
    for index in range(rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, variants[name], use_tqdm=False)
            runs[name].append(num_tokens / (time.perf_counter() - start))
            print(f"round {index}: {name} {runs[name][-1]:.1f} tokens/s", flush=True)
            if name == "json_schema" and constrained_fraction is None:
                constrained_fraction = _constrained_fraction(llm, outputs)
    best = {name: max(values) for name, values in runs.items()}
    return {"num_requests": num_requests, "temperature": temperature, "num_output_tokens": num_tokens, "tokens_per_s_runs": runs,
            "tokens_per_s_best": best, "ratio_json_schema_to_unconstrained": best["json_schema"] / best["unconstrained"],
            "constrained_fraction": constrained_fraction}


def _constrained_fraction(llm, outputs) -> float:
    """The share of output tokens generated while the grammar was still open (before its stop token)."""
    tokenizer = llm.get_tokenizer()
    stops = {tokenizer.eos_token_id}
    constrained = 0
    for output in outputs:
        token_ids = output.outputs[0].token_ids
        end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        constrained += end
    return constrained / sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, recipe A's (the default); > 0: seeded sampling, both variants")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    result: dict[str, object] = {"compile": compile_times()}
    print(json.dumps(result["compile"], indent=1), flush=True)
    if not args.skip_throughput:
        result["throughput"] = throughput(args.num_requests, args.rounds, args.seed, args.temperature)
        print(json.dumps(result["throughput"], indent=1), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
