"""The offline tiny-model factory the suite relies on: tokenizer, configs, clear greedy margins."""
from __future__ import annotations

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import TOKENIZER_VOCAB_SIZE


def test_tokenizer_loads_offline_and_round_trips(tiny_tokenizer_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir, local_files_only=True)
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == \
        ("<s>", "</s>", "<pad>", "<unk>")
    text = "def f(x):\n    return x * 2  # café 😀"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_folders_have_the_requested_shapes(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3")
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    assert config["vocab_size"] == TOKENIZER_VOCAB_SIZE
    assert os.path.isfile(os.path.join(folder, "generation_config.json"))
    mistral = json.load(open(os.path.join(tiny_model_dir("mistral"), "config.json")))
    assert mistral["sliding_window"] == 16
    yarn = json.load(open(os.path.join(tiny_model_dir("llama-rope-yarn"), "config.json")))
    assert yarn["rope_parameters"]["rope_type"] == "yarn"


def test_greedy_argmax_stands_clear_of_noise(tiny_model_dir) -> None:
    """The scaled LM head keeps top-1 vs top-2 gaps far above float32 kernel differences (~1e-5)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), local_files_only=True).eval()
    input_ids = torch.randint(3, TOKENIZER_VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model(input_ids).logits[0].topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.05


def test_tied_models_do_not_just_echo_their_input(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama-tied"), local_files_only=True).eval()
    input_ids = torch.randint(3, TOKENIZER_VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        predicted = model(input_ids).logits[0].argmax(-1)
    assert (predicted == input_ids[0]).float().mean() < 0.5
