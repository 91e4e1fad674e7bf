"""Speculative decoding (ngram prompt lookup) against plain decoding, side by side in one process (issue #29).

Workload: benchmarks/workloads/copy_heavy.json, chat prompts that ask the default model (SmolLM2-135M-Instruct)
to repeat a passage word for word, greedy, max_tokens 160 (EOS ends a request). Both engines are loaded first;
each round times one run of each, the order alternating between rounds; the outputs of the two must be equal
token for token (greedy speculation is lossless). Reported: output tokens/s of every run, each engine's best and
median, the ratio of medians, and the acceptance counters (vllm:spec_decode_*) of the speculative engine.

  batch 1    the prompts one at a time (latency-bound decode: where speculation pays most); also the target as
             its own drafter (method draft_model, K = --num-speculative-tokens): every draft is accepted, so its
             speed against plain decoding is the machinery's cost at 100% acceptance (K + 1 drafter forwards and
             one K + 1 token verification per K + 1 tokens)
  batch N    (--batch-sizes) N requests at once, the passages cycled: speculation always on, and with the
             batch-size table num_speculative_tokens_per_batch_size (--table), which turns it off where it
             does not pay

  --gguf-dequantize  every pagedserve engine runs the default model's GGUF file dequantized to float32 at load (as
             the vLLM side always does) instead of its Q4_1 blocks kept quantized: decode then streams 540 MB of
             weights per step, far past the last-level cache, and a K + 1 token verification reads them once as a
             one-token step does; kept quantized (96 MB, integer products on int16 activations), a verification is
             bound by its products' arithmetic and costs several decode steps

  vLLM       (--vllm-python) vLLM CPU on the same prompts (token ids), weights (pagedserve's float32
             dequantization of the default model, exported as an HF folder) and dtype, batch 1, without and with
             its own ngram speculation (same K and lookup bounds), in its own process after pagedserve's rounds

    python benchmarks/spec_decode.py --rounds 3 --batch-sizes 16 64 [--gguf-dequantize] [--vllm-python DIR/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kind import result_path, write_result_file  # noqa: E402
import native_guard  # noqa: E402

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads", "copy_heavy.json")


def load_prompts(llm, workload: dict) -> list[list[int]]:
    """Each passage as a chat prompt (the model's template), as token ids."""
    from pagedserve.engine.input_processor import apply_chat_template

    return [apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": workload["instruction"] + text}],
                                add_generation_prompt=True) for text in workload["passages"]]


def timed_run(llm, prompts: list[list[int]], max_tokens: int, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt, `batch_size` requests at a time; the output token ids."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    llm.reset_prefix_cache()  # a repeat must not hit the previous run's prompt blocks
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": p} for p in prompts[first:first + batch_size]]
        outputs += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    return time.perf_counter() - start, outputs


def compare(engines: dict[str, object], prompts: list[list[int]], max_tokens: int, batch_size: int,
            rounds: int) -> dict:
    """Interleaved rounds of every engine on the same prompts; tok/s per run, outputs checked equal."""
    names = list(engines)
    tokens_per_s: dict[str, list[float]] = {name: [] for name in names}
    reference: list[list[int]] | None = None
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            seconds, outputs = timed_run(engines[name], prompts, max_tokens, batch_size)
            if reference is None:
                reference = outputs
            elif outputs != reference:
                index = next(i for i, (ours, theirs) in enumerate(zip(outputs, reference)) if ours != theirs)
                position = next((j for j, (ours, theirs) in enumerate(zip(outputs[index], reference[index]))
                                 if ours != theirs), min(len(outputs[index]), len(reference[index])))
                raise AssertionError(f"{name} (round {round_index}): greedy outputs differ from {names[0]}'s first "
                                     f"run's (speculation must be lossless): prompt {index}, token {position}: "
                                     f"{outputs[index][position:position + 4]} vs "
                                     f"{reference[index][position:position + 4]}")
            tokens_per_s[name].append(sum(len(o) for o in outputs) / seconds)
    result = {"batch_size": batch_size, "num_requests": len(prompts),
              "num_output_tokens": sum(len(o) for o in reference or []), "tokens_per_s": tokens_per_s,
              "median_tokens_per_s": {name: statistics.median(v) for name, v in tokens_per_s.items()}}
    base = result["median_tokens_per_s"][names[0]]
    result["ratio_of_medians"] = {name: result["median_tokens_per_s"][name] / base for name in names[1:]}
    return result


# vLLM in its own venv: loads the folder without and with ngram speculation and times batch-1 rounds of each.
VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        folder, dtype, config_path = sys.argv[1], sys.argv[2], sys.argv[3]
        config = json.load(open(config_path))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in config["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], detokenize=False)
        result = {}
        for name, speculative in (("plain", None), ("ngram", config["ngram"])):
            llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=0, skip_tokenizer_init=True,
                      speculative_config=speculative)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            runs, outputs = [], None
            for _ in range(config["rounds"]):
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
                runs.append(sum(len(o) for o in outputs) / (time.perf_counter() - start))
            result[name] = {"tokens_per_s": runs, "outputs": [list(o) for o in outputs]}
            del llm
        print("RESULT " + json.dumps(result), flush=True)

    main()
""")


def run_vllm(vllm_python: str, prompts: list[list[int]], max_tokens: int, ngram: dict, rounds: int,
             dtype: str) -> dict:
    """vLLM CPU's batch-1 tok/s without and with ngram speculation on the default model's weights."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmark_model import default_model_hf_folder

    folder = default_model_hf_folder()
    with tempfile.TemporaryDirectory(prefix="spec-decode-vllm-") as scratch:
        config_path = os.path.join(scratch, "config.json")
        with open(config_path, "w") as handle:
            json.dump({"prompts": prompts, "max_tokens": max_tokens, "ngram": ngram, "rounds": rounds}, handle)
        completed = subprocess.run([vllm_python, "-c", VLLM_SCRIPT, folder, dtype, config_path],
                                   capture_output=True, text=True, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2"))
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        return {"error": f"vLLM exited {completed.returncode}: {completed.stderr[-3000:]}"}
    result = json.loads(lines[-1].removeprefix("RESULT "))
    for name in result:
        result[name]["median_tokens_per_s"] = statistics.median(result[name]["tokens_per_s"])
    return result


def spec_counters(llm) -> dict:
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_rate_per_position": [count / drafts for count in per_position] if drafts else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gguf-dequantize", action="store_true",
                        help="pagedserve runs the GGUF file dequantized at load (float32 weights), as vLLM does")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--table", default="[[1, 8, 4], [9, 1024, 0]]",
                        help="num_speculative_tokens_per_batch_size of the table engine (JSON)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--vllm-python", default=None, help="python of a venv holding vLLM CPU (optional)")
    parser.add_argument("--json-out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pagedserve import LLM

    workload = json.load(open(WORKLOAD))
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    common = dict(model=args.model, dtype=args.dtype, max_model_len=1024, seed=0, gguf_dequantize=args.gguf_dequantize)
    from pagedserve.model_loader.default_model import DEFAULT_MODEL_NAME

    self_draft = {"method": "draft_model", "model": args.model or DEFAULT_MODEL_NAME,
                  "num_speculative_tokens": args.num_speculative_tokens}
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=ngram),
               "self_draft": LLM(**common, speculative_config=self_draft)}
    if args.batch_sizes:
        engines["ngram_table"] = LLM(**common, speculative_config=dict(
            ngram, num_speculative_tokens_per_batch_size=json.loads(args.table)))
    prompts = load_prompts(engines["plain"], workload)
    for llm in engines.values():  # warm-up: first touch of weights and caches
        timed_run(llm, prompts[:1], 8, 1)

    results = {"native_kernels": native_kernels, "workload": os.path.relpath(WORKLOAD), "speculative_config": ngram,
               "gguf_dequantize": args.gguf_dequantize,
               "table": json.loads(args.table),
               "runs": []}
    batch_one = compare({name: engines[name] for name in ("plain", "ngram", "self_draft")}, prompts,
                        workload["max_tokens"], 1, args.rounds)
    batch_one["spec_decode"] = {name: spec_counters(engines[name]) for name in ("ngram", "self_draft")}
    results["runs"].append(batch_one)
    for batch_size in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch_size)]
        batched = {name: engines[name] for name in ("plain", "ngram", "ngram_table")}
        results["runs"].append(compare(batched, batch_prompts, workload["max_tokens"], batch_size, args.rounds))

    label = ("auto" if args.dtype == "auto" else args.dtype) + ("-dequantized" if args.gguf_dequantize else "")
    path = args.json_out or result_path("spec_decode", label)
    write_result_file(results, path)  # before vLLM, whose engines take minutes to load on a small machine
    if args.vllm_python:
        dtype = "float32" if args.dtype == "auto" else args.dtype
        vllm = run_vllm(args.vllm_python, prompts, workload["max_tokens"], ngram, args.rounds, dtype)
        results["vllm"] = vllm
        if "error" in vllm:
            print(f"vLLM: {vllm['error']}")
        else:
            ours = batch_one["median_tokens_per_s"]["ngram"]
            same = vllm["plain"]["outputs"] == vllm["ngram"]["outputs"]
            print(f"vLLM batch 1: median output tok/s plain {vllm['plain']['median_tokens_per_s']:.1f}, ngram "
                  f"{vllm['ngram']['median_tokens_per_s']:.1f} (its outputs with and without ngram equal: {same}); "
                  f"pagedserve ngram / vLLM ngram: {ours / vllm['ngram']['median_tokens_per_s']:.2f}x")
    for run in results["runs"]:
        medians = ", ".join(f"{name} {value:.1f}" for name, value in run["median_tokens_per_s"].items())
        ratios = ", ".join(f"{name} {value:.2f}x" for name, value in run["ratio_of_medians"].items())
        print(f"batch {run['batch_size']:>3}: median output tok/s {medians}; vs plain: {ratios}")
    for name, counters in batch_one["spec_decode"].items():
        print(f"batch 1 {name} acceptance: rate {counters['acceptance_rate']:.3f}, mean acceptance length "
              f"{counters['mean_acceptance_length']:.2f}, per position "
              f"{[round(rate, 3) for rate in counters['acceptance_rate_per_position']]}")
    if args.vllm_python:
        write_result_file(results, path)


if __name__ == "__main__":
    main()
