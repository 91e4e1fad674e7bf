"""Process start to first chat token with the default model, cold (empty cache) and warm.

Runs `pagedserve chat` as a user would (stdin not a TTY, one question) and measures the wall time
from process start to the first byte of the answer on stdout, and to process exit.

    python benchmarks/chat_startup.py [--repeats 3] [--warm-only]
    python benchmarks/chat_startup.py --breakdown [--repeats 3]

`--warm-only` keeps the user's cache (~/.cache/pagedserve or $PAGEDSERVE_CACHE_DIR) and times warm starts
only: the dequantised weights and the native library must already be there (run chat once first).

`--breakdown` runs the same chat in a child process that wraps the start-up's stages (the imports, the
GGUF metadata and config, the tokenizer, the native library load, the model build and weight load, the
huge-page placement, the KV cache, the first token) and prints, per stage, the median wall time and
process CPU time (all threads) over the repeats, warm. The machine's other load inflates wall times
more than CPU times: compare both.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import native_guard

QUESTION = b"What is the capital of France?\n"
# The checkout this script lives in is the one measured (ahead of any installed copy).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_ARGS = ["chat", "--temperature", "0", "--max-tokens", "32"]

# (label, module, qualified name) of the stages --breakdown times; a stage whose module or function does
# not exist in this checkout is skipped.
STAGES = (
    ("engine config (model source, HF config)", "pagedserve.config.engine", "EngineConfig.create"),
    ("  GGUF fingerprint (sha256 of the file)", "pagedserve.model_loader.gguf_cache", "source_fingerprint"),
    ("  GGUF metadata cache read", "pagedserve.model_loader.gguf_cache", "MetadataCache.read"),
    ("  HF config (transformers config class)", "pagedserve.model_loader.gguf_loader", "build_hf_config"),
    ("  HF config (snapshot or transformers class)", "pagedserve.model_loader.hf_config_snapshot", "load_config"),
    ("  native library load", "pagedserve.kernels.cpu_library", "load_native_extension"),
    ("  native library load", "pagedserve.attention.cpu_native_extension", "load_native_extension"),
    ("LLMEngine()", "pagedserve.engine.llm_engine", "LLMEngine.__init__"),
    ("  tokenizer load", "pagedserve.model_loader.model_source", "ModelSource.load_tokenizer"),
    ("    tokenizer from GGUF metadata (imports transformers)", "pagedserve.model_loader.gguf_tokenizer",
     "build_tokenizer"),
    ("  Worker()", "pagedserve.worker.worker", "Worker.__init__"),
    ("    load_model", "pagedserve.model_loader.model_factory", "load_model"),
    ("      model construction", "pagedserve.models.llama", "LlamaForCausalLM.__init__"),
    ("      model.load_weights", "pagedserve.models.llama", "LlamaForCausalLM.load_weights"),
    ("      apply_weight_layout", "pagedserve.layers.weight_layout", "apply_weight_layout"),
    ("    weights to huge pages", "pagedserve.platforms.huge_page_weights", "move_weights_to_huge_pages"),
    ("    ModelRunner()", "pagedserve.worker.model_runner", "ModelRunner.__init__"),
    ("    KV cache allocation", "pagedserve.worker.kv_cache_allocation", "allocate_kv_caches"),
    ("run_chat (template, steps, output)", "pagedserve.chat", "run_chat"),
    ("  chat template", "pagedserve.engine.input_processor", "apply_chat_template"),
    ("  engine steps", "pagedserve.engine.llm_engine", "LLMEngine.step"),
    ("LLMEngine.shutdown", "pagedserve.engine.llm_engine", "LLMEngine.shutdown"),
)


def time_to_first_token(cache_dir: str | None, command: list[str] | None = None) -> tuple[float, float, str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    if cache_dir is not None:
        env["PAGEDSERVE_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    process = subprocess.Popen(command or [sys.executable, "-m", "pagedserve.cli", *CHAT_ARGS],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    process.stdin.write(QUESTION)
    process.stdin.close()
    first = process.stdout.read(1)
    first_token_s = time.perf_counter() - start
    rest = process.stdout.read()
    stderr = process.stderr.read()
    process.wait()
    return (first_token_s, time.perf_counter() - start, (first + rest).decode(errors="replace").strip(),
            stderr.decode(errors="replace"))


def _process_age_s() -> float:
    """Seconds since this process started (interpreter start-up included), from /proc."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def _child_breakdown() -> None:
    """Runs `pagedserve chat` in this process with its stages wrapped; the stage times go to stderr as JSON."""
    records: dict[str, list[float]] = {}  # label -> [calls, wall, cpu]
    marks: dict[str, tuple[float, float]] = {}
    t0_wall = time.perf_counter() - _process_age_s()

    def mark(name: str) -> None:
        marks.setdefault(name, (time.perf_counter() - t0_wall, time.process_time()))

    mark("interpreter start-up")
    import pagedserve.cli

    # The imports run as the command runs them (with its start-up's garbage collector settings, where it has any).
    with getattr(pagedserve.cli, "_start_up", contextlib.nullcontext)():
        mark("import pagedserve.cli")
        import torch  # noqa: F401  (timed on its own: every path pays it)
        mark("import torch")
        import pagedserve.chat  # noqa: F401
        import pagedserve.engine.llm_engine  # noqa: F401
        mark("import pagedserve (chat, engine)")

    def wrap(label: str, function):  # type: ignore[no-untyped-def]
        @functools.wraps(function)
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                record = records.setdefault(label, [0, 0.0, 0.0])
                record[0] += 1
                record[1] += time.perf_counter() - wall
                record[2] += time.process_time() - cpu
        return timed

    for label, module_name, qualname in STAGES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner, _, name = qualname.rpartition(".")
        holder = getattr(module, owner) if owner else module
        raw = vars(holder).get(name) if owner else getattr(module, name, None)
        if raw is None:
            continue
        if isinstance(raw, classmethod):
            setattr(holder, name, classmethod(wrap(label, raw.__func__)))
        elif isinstance(raw, staticmethod):
            setattr(holder, name, staticmethod(wrap(label, raw.__func__)))
        else:
            timed = wrap(label, raw)
            setattr(holder, name, timed)
            if not owner:  # re-point `from module import name` bindings made by modules imported already
                for other in list(sys.modules.values()):
                    if getattr(other, name, None) is raw:
                        setattr(other, name, timed)
    write = pagedserve.chat._write

    def first_write(text: str) -> None:
        mark("first token on stdout")
        write(text)

    pagedserve.chat._write = first_write
    mark("stages wrapped")
    code = pagedserve.cli.main(CHAT_ARGS)
    mark("chat done")
    sys.stdout.flush()
    sys.stderr.write("BREAKDOWN " + json.dumps({"records": records, "marks": marks}) + "\n")
    sys.exit(code)


def breakdown(repeats: int) -> None:
    command = [sys.executable, os.path.abspath(__file__), "--child-breakdown"]
    runs = []
    for _ in range(repeats):
        _, total_s, answer, stderr = time_to_first_token(None, command=command)
        line = next((line for line in stderr.splitlines() if line.startswith("BREAKDOWN ")), None)
        if line is None:
            raise SystemExit(f"the child printed no breakdown:\n{stderr}")
        runs.append(json.loads(line.removeprefix("BREAKDOWN ")))
        runs[-1]["total"] = total_s
        runs[-1]["answer"] = answer
    print(f"warm start breakdown, median of {repeats} runs (wall s / process CPU s, all threads)")
    print("since process start (cumulative):")
    previous = (0.0, 0.0)
    for name in runs[0]["marks"]:
        walls = [run["marks"][name][0] for run in runs if name in run["marks"]]
        cpus = [run["marks"][name][1] for run in runs if name in run["marks"]]
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(f"  {name:<40} at {wall:6.2f} s  (+{wall - previous[0]:5.2f} wall, +{cpu - previous[1]:5.2f} cpu)")
        previous = (wall, cpu)
    print(f"  {'process exit (parent view)':<40} at {statistics.median(run['total'] for run in runs):6.2f} s")
    print("stages (inclusive; indented stages run inside the one above in this checkout's code, older code may "
          "call them elsewhere):")
    seen = []
    for label, _, _ in STAGES:
        if label not in seen and any(label in run["records"] for run in runs):
            seen.append(label)
    for label in seen:
        rows = [run["records"][label] for run in runs if label in run["records"]]
        calls = int(statistics.median(row[0] for row in rows))
        print(f"  {label:<56} {statistics.median(row[1] for row in rows):6.2f} wall "
              f"{statistics.median(row[2] for row in rows):6.2f} cpu  ({calls} call{'s' if calls != 1 else ''})")
    print("answer:", runs[-1]["answer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-only", action="store_true", help="time warm starts on the user's cache")
    parser.add_argument("--breakdown", action="store_true", help="per-stage times of warm starts")
    parser.add_argument("--child-breakdown", action="store_true", help=argparse.SUPPRESS)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    if args.child_breakdown:
        _child_breakdown()
        return
    # The chats run in children with this environment (PAGEDSERVE_CPU_ISA); the check loads the library here.
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.breakdown:
        breakdown(args.repeats)
        return
    cold, warm = [], []
    for _ in range(args.repeats):
        if args.warm_only:
            warm.append(time_to_first_token(None))
            continue
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(time_to_first_token(cache_dir))
            warm.append(time_to_first_token(cache_dir))
    for name, runs in (("cold (no cache)", cold), ("warm (cache present)", warm)):
        if not runs:
            continue
        firsts = [r[0] for r in runs]
        totals = [r[1] for r in runs]
        print(f"{name:<22} first token median {statistics.median(firsts):6.2f} s (min {min(firsts):.2f})   "
              f"exit median {statistics.median(totals):6.2f} s")
    print("answer:", warm[-1][2])


if __name__ == "__main__":
    main()
