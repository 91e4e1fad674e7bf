"""A random Llama with SmolLM2-135M-Instruct's shape, built offline for benchmarks (cached on disk)."""
from __future__ import annotations

import os

import torch

SMOLLM2_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5,
)


def build_word_level_tokenizer(folder: str, vocab_size: int) -> None:
    """A tokenizer whose vocabulary is `vocab_size` synthetic words (benchmarks feed token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def benchmark_model_folder(root: str | None = None) -> str:
    """Build (once) and return the folder of the random SmolLM2-shaped Llama, saved in float32."""
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "benchmark-models")
    folder = os.path.join(root, "random-llama-smollm2-shape")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    from transformers import AutoModelForCausalLM, LlamaConfig

    os.makedirs(folder, exist_ok=True)
    config = LlamaConfig(bos_token_id=1, eos_token_id=2, **SMOLLM2_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(folder)
    build_word_level_tokenizer(folder, SMOLLM2_SHAPE["vocab_size"])
    return folder


def default_model_hf_folder(root: str | None = None) -> str:
    """Build (once) and return an HF folder of the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF file):
    its weights dequantized to float32, its config and tokenizer. What engines that do not read GGUF (vLLM CPU) load
    beside pagedserve on the same weights."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_vs_llama_cpp import export_hf_folder

    from pagedserve.model_loader.default_model import DEFAULT_MODEL_NAME, resolve_model_path
    from pagedserve.model_loader.gguf_loader import load_gguf

    root = root or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "benchmark-models")
    folder = os.path.join(root, "smollm2-135m-instruct-hf")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        os.makedirs(folder, exist_ok=True)
        export_hf_folder(load_gguf(resolve_model_path(DEFAULT_MODEL_NAME), torch.float32), folder)
    return folder


def sharded_benchmark_model_folder(max_shard_bytes: int = 128 << 20, root: str | None = None) -> str:
    """Build (once) and return a copy of the benchmark model cut into several safetensors shards of at
    most `max_shard_bytes` (HF's model-XXXXX-of-XXXXX.safetensors + model.safetensors.index.json), for
    loading benchmarks that need more than one file."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    source = benchmark_model_folder(root)
    folder = f"{source}-sharded-{max_shard_bytes >> 20}mib"
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        return folder
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), folder)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    with safe_open(os.path.join(source, "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            num_bytes = tensor.numel() * tensor.element_size()
            if shards[-1] and sizes[-1] + num_bytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = tensor
            sizes[-1] += num_bytes
    weight_map = {}
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
    return folder
