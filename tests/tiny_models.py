"""Offline factory for tiny HF checkpoints used across the test suite.

Nothing here touches a model hub: a byte-level BPE tokenizer is trained on a fixed built-in corpus and
tiny random models are built with transformers' own classes, then saved as ordinary HF folders
(config.json + safetensors + tokenizer files + generation_config.json).

The LM head is scaled up after init (for tied models: the final norm, see build_tiny_model) so that
the logits have a clear argmax: with plain random init the top-2 logits of a tiny model are often within
float noise of each other, which would make greedy-parity tests flaky across numerically different (but
equivalent) kernels.
"""
from __future__ import annotations

import os
from typing import Any

import torch

TOKENIZER_VOCAB_SIZE = 640
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

# ChatML-like template; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, my name is Alice and I like to write small programs in Python.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Once upon a time there was a little robot who wanted to learn how to paint.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "The future of artificial intelligence is bright, but it needs careful engineering.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch at every step.",
    "What is the meaning of life? Some say forty-two, others say it is to be kind.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Request:\n    def __init__(self, request_id, prompt):\n        self.request_id = request_id\n",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\n",
    "{\"name\": \"pagedserve\", \"version\": \"0.1.0\", \"tags\": [\"llm\", \"inference\"]}",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
    "<html><body><p>Hello world</p></body></html>",
    "Unicode: café, naïve, über, façade, jalapeño, Straße, smörgåsbord.",
    "日本語のテキスト。中文文本。한국어 텍스트. Русский текст. Ελληνικά.",
    "Emoji: 😀 🚀 🎉 👍 ❤️ 🔥 — dashes – and “quotes” ‘too’ … ellipsis.",
    "Math: ∑ x² ≤ ∞, α β γ δ ε, √2 ≈ 1.414, π ≈ 3.14159.",
    "user: Can you summarise this text for me?\nassistant: Sure, here is a short summary.",
    "The weather today is sunny with a light breeze from the west.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
]


def tiny_corpus() -> list[str]:
    """The fixed training corpus (repeated so BPE sees enough pair counts)."""
    return _CORPUS * 4


def build_tiny_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """Train a tiny byte-level BPE tokenizer, save it into `folder` and return it.

    The folder then loads offline with `AutoTokenizer.from_pretrained(folder)`. Special tokens:
    bos "<s>", eos "</s>", pad "<pad>", unk "<unk>", plus ChatML markers for the chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    # Prepend BOS like Llama tokenizers do, so prompts start with a known token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


# kind -> (HF config class name, config kwargs). Shared sizes are filled in by `_config_kwargs`.
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

MODEL_KINDS = (
    "llama",
    "llama-untied",
    "llama-tied",
    "qwen2",
    "qwen2-sliding",
    "qwen3",
    "mistral",
    "llama-rope-llama3",
    "llama-rope-linear",
    "llama-rope-dynamic",
    "llama-rope-yarn",
    "qwen3-moe",
    "qwen2-moe",
    "mixtral",
    "deepseek-v2",
    "deepseek-v3",
    "glm4-moe",
    "deepseek-v32",
    "glm-moe-dsa",
)

# MoE kinds: 8 experts, top-2, tiny experts; the DeepSeek kinds use MLA (num_key_value_heads must equal
# num_attention_heads for HF's MLA) and a dense first layer (first_k_dense_replace=1).
MOE_KINDS = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v2", "deepseek-v3", "glm4-moe")
_MOE_COMMON: dict[str, Any] = dict(num_experts_per_tok=2, tie_word_embeddings=False)
_MLA: dict[str, Any] = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                            first_k_dense_replace=1)
_MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                         mlp_only_layers=[], use_sliding_window=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, sliding_window=None)),
    "deepseek-v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                             n_group=2, topk_group=1, routed_scaling_factor=1.5)),
    "deepseek-v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5)),
    "glm4-moe": ("Glm4MoeConfig", dict(head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                                       moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                                       routed_scaling_factor=1.8)),
}
# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA + MoE + the lightning indexer. index_topk 8 is below the
# test prompts' lengths, so the selection really drops tokens. 16 index heads: a key whose ReLU terms are all zero
# scores exactly 0, and ties at the top-k boundary would let HF and pagedserve pick different (equal) tokens.
# GLM-5's three layers are full, shared, full.
DSA_KINDS = ("deepseek-v32", "glm-moe-dsa")
_DSA: dict[str, Any] = dict(_MLA, q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5, index_topk=8,
                            index_head_dim=16, index_n_heads=16)
_MOE_CONFIGS["deepseek-v32"] = ("DeepseekV32Config", dict(_DSA, n_group=4, topk_group=2))
_MOE_CONFIGS["glm-moe-dsa"] = ("GlmMoeDsaConfig", dict(_DSA, n_group=2, topk_group=1, num_hidden_layers=3,
                                                       indexer_types=["full", "shared", "full"]))
# Router weights are scaled up (and correction biases randomised) so that expert choices stand clear of
# float noise, as the LM head is for tokens.
ROUTER_WEIGHT_SCALE = 4.0
# Likewise the indexer's query and key projections, so that index scores (and the top-k they pick) stand clear too.
INDEXER_WEIGHT_SCALE = 4.0

_ROPE_SCALING: dict[str, dict[str, Any]] = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}


def _config_for(kind: str, vocab_size: int, special_ids: dict[str, int], dtype: torch.dtype,
                overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kwargs: dict[str, Any] = dict(_BASE)
    kwargs.update(vocab_size=vocab_size, **special_ids)
    if kind == "llama" or kind == "llama-untied":
        config_class, kwargs["tie_word_embeddings"] = LlamaConfig, False
    elif kind == "llama-tied":
        config_class, kwargs["tie_word_embeddings"] = LlamaConfig, True
    elif kind.startswith("llama-rope-"):
        rope_type = kind[len("llama-rope-"):]
        if rope_type not in _ROPE_SCALING:
            raise ValueError(f"kind={kind!r}: rope type {rope_type!r} not in {sorted(_ROPE_SCALING)}")
        config_class, kwargs["tie_word_embeddings"] = LlamaConfig, False
        kwargs["rope_scaling"] = dict(_ROPE_SCALING[rope_type], rope_theta=kwargs["rope_theta"])
    elif kind == "qwen2":
        config_class = Qwen2Config
        kwargs.update(tie_word_embeddings=False, use_sliding_window=False)
    elif kind == "qwen2-sliding":
        # Sliding window on the layers from max_window_layers on (HF `layer_types`): layer 0 full, 1 sliding.
        config_class = Qwen2Config
        kwargs.update(tie_word_embeddings=False, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    elif kind == "qwen3":
        # head_dim (32) * heads (4) = 128 != hidden (64): exercises head_dim taken from the config.
        config_class = Qwen3Config
        kwargs.update(tie_word_embeddings=True, head_dim=32, use_sliding_window=False)
    elif kind in _MOE_CONFIGS:
        import transformers

        class_name, moe_kwargs = _MOE_CONFIGS[kind]
        config_class = getattr(transformers, class_name)
        kwargs.update(_MOE_COMMON, **moe_kwargs)
        partial = kwargs.pop("partial_rotary_factor", None)
        if partial is not None:
            kwargs["rope_scaling"] = {"rope_type": "default", "rope_theta": kwargs["rope_theta"],
                                      "partial_rotary_factor": partial}
    elif kind == "mistral":
        # A window shorter than the test prompts, so sliding-window masking really matters.
        config_class = MistralConfig
        kwargs.update(tie_word_embeddings=False, sliding_window=16)
    else:
        raise ValueError(f"kind={kind!r} is not a tiny model kind; allowed: {list(MODEL_KINDS)}")
    kwargs.update(overrides)
    # transformers 5 keeps rope parameters under `rope_parameters`; give both spellings a chance.
    rope_scaling = kwargs.pop("rope_scaling", None)
    config = config_class(**kwargs)
    if rope_scaling is not None:
        config.rope_parameters = dict(rope_scaling)
    config.dtype = dtype
    return config


def build_tiny_model(
    kind: str,
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    lm_head_scale: float = 8.0,
    tied_layer_weight_scale: float = 3.0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> str:
    """Build a tiny random HF model of `kind` (see MODEL_KINDS) into `folder`; return the folder path.

    `overrides` are passed to the HF config (e.g. num_hidden_layers=4, rope_scaling={...}).
    `max_shard_size` (e.g. "20KB") writes a sharded checkpoint with model.safetensors.index.json.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = os.fspath(folder)
    tokenizer = build_tiny_tokenizer(folder)
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = _config_for(kind, len(tokenizer), special_ids, dtype, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if config.tie_word_embeddings:
            # A tied random model mostly echoes its input token: the scaled-up embedding would dominate the
            # residual stream and the logits. Strengthen the decoder layers instead, and scale the logits
            # through the final norm so the input embedding keeps its size.
            for parameter in model.model.layers.parameters():
                if parameter.dim() == 2:
                    parameter.mul_(tied_layer_weight_scale)
            model.model.norm.weight.mul_(lm_head_scale)
        else:
            # Scale the output projection so the argmax stands clear of float noise (see module docstring).
            model.get_output_embeddings().weight.mul_(lm_head_scale)
        if kind in DSA_KINDS:
            # HF initialises the indexer's key norm to the identity: perturb it so that loading it matters.
            generator = torch.Generator().manual_seed(seed + 1)
            for name, tensor in model.named_parameters():
                if name.endswith("indexer.k_norm.weight"):
                    tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=generator))
                elif name.endswith("indexer.k_norm.bias"):
                    tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
                elif name.endswith(("indexer.wq_b.weight", "indexer.wk.weight")):
                    tensor.mul_(INDEXER_WEIGHT_SCALE)
        if kind in MOE_KINDS or kind in DSA_KINDS:
            for name, tensor in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    tensor.mul_(ROUTER_WEIGHT_SCALE)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    model = model.to(dtype)
    model.eval()
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **save_kwargs)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(folder)
    return folder
