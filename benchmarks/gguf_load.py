"""Benchmark: loading the embedded SmolLM2-135M-Instruct Q4_1 GGUF into HF-named float32 tensors.

    python benchmarks/gguf_load.py [--model PATH] [--dtype float32|bfloat16]

Measures, after imports are warm (importing torch/transformers is not counted):
  ours cold   load_gguf(..., use_cache=True) on an empty cache folder: parse + dequantize + write cache
  ours warm   the same with the cache in place: fingerprint + read the cache
  ours nocache  load_gguf(..., use_cache=False): parse + dequantize
  transformers  AutoModelForCausalLM.from_pretrained(folder, gguf_file=name) (builds the model too)
Each of ours includes building the config and the tokenizer and materialising every weight.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _time_ours(path: str, dtype: torch.dtype, use_cache: bool) -> float:
    from pagedserve.model_loader.gguf_loader import load_gguf

    start = time.perf_counter()
    model = load_gguf(path, dtype, use_cache=use_cache)
    _ = model.tokenizer
    num_values = sum(tensor.numel() for _, tensor in model.weights())
    elapsed = time.perf_counter() - start
    assert num_values > 0
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: F401  (warm imports)

    from pagedserve.model_loader.default_model import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    print(f"file: {path} ({os.path.getsize(path) / 1e6:.1f} MB), dtype {args.dtype}, "
          f"{torch.get_num_threads()} torch threads")
    with tempfile.TemporaryDirectory() as cache_folder:
        os.environ["PAGEDSERVE_CACHE_DIR"] = cache_folder
        cold = _time_ours(path, dtype, use_cache=True)
        warm = _time_ours(path, dtype, use_cache=True)
        no_cache = _time_ours(path, dtype, use_cache=False)
    print(f"pagedserve cold (parse + dequantize + write cache): {cold:6.2f} s")
    print(f"pagedserve warm (cache hit):                         {warm:6.2f} s")
    print(f"pagedserve without cache (parse + dequantize):       {no_cache:6.2f} s")
    if not args.skip_transformers:
        start = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        print(f"transformers GGUF load (from_pretrained):            {time.perf_counter() - start:6.2f} s")


if __name__ == "__main__":
    main()
