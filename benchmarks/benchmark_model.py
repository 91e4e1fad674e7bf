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
