"""A GGUF file of a random llama-architecture model too large for the last-level cache (recipe B against llama.cpp
where a decode token's weights stream from memory, as on CPUs whose cache is smaller than the model).

The default model (SmolLM2-135M, ~100 MB as Q4_1) fits the 300 MiB L3 of an Emerald Rapids VM, so there its batch-1
decode reads the weights from the cache, and a bandwidth probe of memory understates what it can stream. This makes
a model of the default model's family and tokenizer, scaled up (default: hidden 2048, 16 layers, MLP 5632, 32
heads, 8 KV heads: 0.82 B parameters, ~560 MB as Q4_1 with the
tied embedding in Q8_0 as in the default model's file), with seeded random weights (normal, std 0.02): an HF folder,
llama.cpp's convert_hf_to_gguf.py to an F32 GGUF, then llama_model_quantize to --type. Both engines then run it:

    python benchmarks/large_gguf.py --llama-python DIR/bin/python --convert-script SRC/convert_hf_to_gguf.py
    python benchmarks/decode_vs_llama_cpp.py --dtype q4_1 --gguf <the printed path> --llama-python DIR/bin/python

The files go to <pagedserve cache>/llama-cpp/ (the F32 one is removed after quantizing unless --keep-f32); a file
already there is reused. convert_hf_to_gguf.py needs sentencepiece under this python (decode_vs_llama_cpp.py's
docstring says how to keep it out of the environment).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_vs_llama_cpp import LLAMA_FTYPES, quantized_gguf  # noqa: E402

from pagedserve.model_loader.default_model import resolve_model_path  # noqa: E402
from pagedserve.model_loader.gguf_cache import cache_root  # noqa: E402
from pagedserve.model_loader.gguf_loader import load_gguf  # noqa: E402

# The token embedding (the tied LM head) in Q8_0, as in the default model's file (llama.cpp would make it Q6_K).
GGML_Q8_0 = 8


def write_hf_folder(folder: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                    seed: int) -> None:
    """The default model's config with the given shape, its tokenizer, and seeded random float32 weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    default = load_gguf(resolve_model_path(None), torch.float32)
    config = LlamaConfig(**{**default.hf_config.to_dict(), "hidden_size": hidden, "num_hidden_layers": layers,
                            "intermediate_size": intermediate, "num_attention_heads": heads,
                            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "torch_dtype": "float32"})
    with torch.device("meta"):  # shapes and names only: the weights come from `generator`
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, parameter in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if parameter.dim() == 1:  # norms
            weights[name] = torch.ones(parameter.shape)
        else:
            weights[name] = torch.randn(parameter.shape, generator=generator) * 0.02
    config.save_pretrained(folder)
    default.tokenizer.save_pretrained(folder)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", required=True, help="python of the llama-cpp-python venv")
    parser.add_argument("--convert-script", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--type", default="q4_1", choices=sorted(LLAMA_FTYPES), help="the file's quantization")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-f32", action="store_true", help="keep the F32 GGUF the quantized file is made from")
    args = parser.parse_args()
    gguf_dir = os.path.join(cache_root(), "llama-cpp")
    stem = (f"random-llama-h{args.hidden}-l{args.layers}-i{args.intermediate}-a{args.heads}-kv{args.kv_heads}"
            f"-s{args.seed}")
    source = os.path.join(gguf_dir, f"{stem}-f32.gguf")
    target = source.replace("-f32.gguf", f"-{args.type}.gguf")
    if not os.path.isfile(target):
        os.makedirs(gguf_dir, exist_ok=True)
        if not os.path.isfile(source):
            with tempfile.TemporaryDirectory(dir=gguf_dir, prefix=".large-") as scratch:
                folder, converted = os.path.join(scratch, "hf"), os.path.join(scratch, "model.gguf")
                write_hf_folder(folder, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
                                args.seed)
                completed = subprocess.run([sys.executable, args.convert_script, folder, "--outtype", "f32",
                                            "--outfile", converted], capture_output=True, text=True)
                if completed.returncode != 0:
                    raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {completed.returncode}):\n"
                                       f"{completed.stderr[-8000:]}")
                os.replace(converted, source)
        quantized_gguf(args.llama_python, source, args.type, token_embedding_type=GGML_Q8_0)
        if not args.keep_f32:
            os.remove(source)
    print(target)


if __name__ == "__main__":
    main()
