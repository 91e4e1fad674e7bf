"""GGUF weights kept quantized (model_loader/gguf_quantized_load.py, layers/gguf_linear.py): which modules keep
their blocks, that the engine then generates what transformers generates from the same file's dequantized weights,
and that it is the default with `gguf_dequantize=True` and a missing native build keeping the old path."""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.torch import save_file

from generation_helpers import model_runner_forward
from hf_reference import hf_greedy_with_logprobs
from native_marks import NEEDS_GGUF_KERNELS
from pagedserve import LLM, SamplingParams
from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.gguf_linear import (GGUF_LINEAR_METHOD, GGUF_PARTS_LINEAR_METHOD, INTERLEAVED_TYPE_OFFSET,
                                           block_type, interleaves)
from pagedserve.layers.linear import LinearBase
from pagedserve.model_loader.gguf_loader import load_gguf
from pagedserve.models.native_decode_stack import NativeDecodeForward
from test_gguf_tiny_files import write_tiny_gguf

pytestmark = NEEDS_GGUF_KERNELS

NUM_STEPS = 32
# Logprob by which a pick may trail transformers' argmax (assert_transformers_argmax).
ARGMAX_TOLERANCE = 0.02
PROMPTS = [[5, 40, 77, 100, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 150], [260, 4]]


def _model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    return [output.outputs[0].token_ids for output in
            llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)]


def _hf_folder_of(gguf_path: str, folder: str) -> str:
    """An HF folder holding the GGUF file's config and its weights dequantized to float32 (by the reference
    decoders, themselves bitwise gguf-py's)."""
    model = load_gguf(gguf_path, use_cache=False)
    os.makedirs(folder, exist_ok=True)
    model.hf_config.save_pretrained(folder)
    save_file({name: tensor.contiguous() for name, tensor in model.weights(torch.float32)},
              os.path.join(folder, "model.safetensors"))
    return folder


def assert_transformers_argmax(folder: str, outputs: list[list[int]]) -> None:
    """Every token of `outputs` (greedy continuations of PROMPTS) is transformers' argmax on the dequantized weights,
    given the same prefix, or within ARGMAX_TOLERANCE of it: the int8 activations of the Q8_0 / Q4_0 / Q4_1 decode
    products move logits by ~1e-3 (tests/layers/test_gguf_linear.py bounds them), so a near tie may pick the other
    token, after which the sequences differ. Also counts that the picks are mostly exact."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    num_exact = num_steps = 0
    for prompt, tokens in zip(PROMPTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        best = logprobs.max(dim=-1).values
        assert bool((picked >= best - ARGMAX_TOLERANCE).all()), (prompt, tokens, (best - picked).max())
        num_exact += int((picked == best).sum())
        num_steps += len(tokens)
    assert num_exact >= 0.9 * num_steps, (num_exact, num_steps)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("gguf-kept")
    files = {}
    for name, architecture, ggml_type, with_output in (
            ("llama-q4_1", "llama", GGMLQuantizationType.Q4_1, False),
            ("llama-q8_0-head", "llama", GGMLQuantizationType.Q8_0, True),
            ("qwen2-q5_0", "qwen2", GGMLQuantizationType.Q5_0, True)):
        path = str(folder / f"{name}.gguf")
        write_tiny_gguf(path, architecture, ggml_type, with_output=with_output, seed=len(files) + 3,
                        norm_weights_near_one=True)
        files[name] = path
    return files


@pytest.mark.parametrize("name", ["llama-q4_1", "llama-q8_0-head", "qwen2-q5_0"])
def test_greedy_picks_are_transformers_argmax_on_the_dequantized_weights(tiny_files, tmp_path, name: str) -> None:
    path = tiny_files[name]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    model = _model_of(llm)
    quantized = [module for module in model.modules() if isinstance(module, LinearBase)
                 and module.linear_method is GGUF_LINEAR_METHOD]
    assert len(quantized) == 8  # qkv, o, gate_up, down in both layers
    assert all(module.weight.dtype == torch.uint8 for module in quantized)
    assert model.model.embed_tokens.ggml_type is not None and model.lm_head.linear_method is GGUF_LINEAR_METHOD
    assert_transformers_argmax(_hf_folder_of(path, str(tmp_path / "hf")), _greedy(llm))


@pytest.mark.parametrize("name", ["llama-q4_1", "llama-q8_0-head"])
def test_interleaving_on_and_off_both_pick_transformers_argmax(tiny_files, tmp_path, monkeypatch, name: str) -> None:
    """The interleaved layout (on: where the kernels read the type fast) and the file's layout (off): each engine's
    greedy picks are transformers' argmax on the dequantized weights, and the modules name their layout."""
    import pagedserve.model_loader.model_factory as model_factory

    path = tiny_files[name]
    interleaved = _model_of(LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128))
    monkeypatch.setattr(model_factory, "interleave_kept_modules", lambda model: 0)
    file_layout_llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    file_layout = _model_of(file_layout_llm)
    for module_on, module_off in zip(interleaved.modules(), file_layout.modules()):
        if getattr(module_off, "ggml_type", None) is None:
            continue
        assert block_type(module_off.ggml_type) == module_off.ggml_type  # the file's layout
        expected = (module_off.ggml_type + INTERLEAVED_TYPE_OFFSET
                    if interleaves(module_off.ggml_type, module_off.weight.shape[0]) else module_off.ggml_type)
        assert module_on.ggml_type == expected
    assert_transformers_argmax(_hf_folder_of(path, str(tmp_path / "hf")), _greedy(file_layout_llm))


@pytest.mark.parametrize("gguf_dequantize", [False, True])
def test_a_gguf_drafter_keeps_its_blocks_as_the_target_does(tiny_files, gguf_dequantize: bool) -> None:
    """Speculative decoding's draft_model from a GGUF file loads as the target does (kept quantized by default,
    dequantized with gguf_dequantize): the target as its own drafter then computes the target's own picks, so it
    accepts every draft, and the output is the plain engine's."""
    path = tiny_files["llama-q4_1"]
    common = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, gguf_dequantize=gguf_dequantize)
    plain = _greedy(LLM(path, **common))
    llm = LLM(path, **common, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    drafter = runner.kv_cache_modules[1]
    assert drafter is not runner.model
    quantized = [module for module in drafter.modules() if isinstance(module, LinearBase)
                 and module.linear_method is GGUF_LINEAR_METHOD]
    assert len(quantized) == (0 if gguf_dequantize else 8)
    assert _greedy(llm) == plain
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    assert draft_tokens > 0 and metrics["vllm:spec_decode_num_accepted_tokens"].value == draft_tokens


def test_tied_head_shares_the_embedding_blocks_and_memory_is_the_files(tiny_files) -> None:
    path = tiny_files["llama-q4_1"]
    model = _model_of(LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.ggml_type == model.model.embed_tokens.ggml_type
    assert block_type(model.lm_head.ggml_type) == GGMLQuantizationType.Q4_1.value
    # The blocks themselves: the 2-D weights hold the file's payload bytes, the embedding padded to 64-row groups.
    file_bytes = sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors if len(tensor.shape) == 2)
    embedding = model.model.embed_tokens
    padding = (embedding.num_embeddings_per_partition - embedding.org_vocab_size) * embedding.weight.shape[1]
    resident = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters()
                   if parameter.dim() == 2)
    assert resident == file_bytes + padding


def test_mixed_types_in_a_fused_layer_keep_each_parts_blocks(tmp_path, monkeypatch) -> None:
    """Q4_K_M-style: attn_v (layer 0) and ffn_up (layer 1) in another type than the other parts of their fused
    layers: those layers keep each part's blocks (GGUFPartsLinearMethod) in one flat weight of the file's bytes, with
    interleaving on (the parts that interleave do) and off, and the output is transformers' on the dequantized
    weights."""
    import pagedserve.model_loader.model_factory as model_factory

    path = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q4_1, seed=11,
                    tensor_types={"blk.0.attn_v.weight": GGMLQuantizationType.Q8_0,
                                  "blk.1.ffn_up.weight": GGMLQuantizationType.Q5_0}, norm_weights_near_one=True)
    folder = _hf_folder_of(path, str(tmp_path / "hf"))
    file_bytes = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}
    for interleaving in (True, False):
        if not interleaving:
            monkeypatch.setattr(model_factory, "interleave_kept_modules", lambda model: 0)
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
        layers = _model_of(llm).model.layers
        qkv, gate_up = layers[0].self_attn.qkv_proj, layers[1].mlp.gate_up_proj
        assert qkv.linear_method is GGUF_PARTS_LINEAR_METHOD and gate_up.linear_method is GGUF_PARTS_LINEAR_METHOD
        assert [(part.shard_id, block_type(part.ggml_type)) for part in qkv.gguf_parts] == [
            ("q", GGMLQuantizationType.Q4_1.value), ("k", GGMLQuantizationType.Q4_1.value),
            ("v", GGMLQuantizationType.Q8_0.value)]
        assert [(part.shard_id, block_type(part.ggml_type)) for part in gate_up.gguf_parts] == [
            (0, GGMLQuantizationType.Q4_1.value), (1, GGMLQuantizationType.Q5_0.value)]
        assert [part.ggml_type != block_type(part.ggml_type) for part in qkv.gguf_parts] == [
            interleaving and interleaves(block_type(part.ggml_type), part.num_rows) for part in qkv.gguf_parts]
        assert qkv.weight.dtype == torch.uint8 and qkv.weight.numel() == sum(
            file_bytes[f"blk.0.attn_{part}.weight"] for part in "qkv")
        assert gate_up.weight.numel() == file_bytes["blk.1.ffn_gate.weight"] + file_bytes["blk.1.ffn_up.weight"]
        assert layers[1].self_attn.qkv_proj.linear_method is GGUF_LINEAR_METHOD
        assert layers[0].mlp.gate_up_proj.linear_method is GGUF_LINEAR_METHOD
        assert_transformers_argmax(folder, _greedy(llm))


def test_k_quant_file_keeps_its_blocks_and_picks_transformers_argmax(tmp_path) -> None:
    """A Q4_K_M-style file of K-quants (hidden 256: whole super-blocks): Q4_K, with layer 0's v and layer 1's down in
    Q6_K and layer 1's up in Q5_K, so that both fused layers of kinds mix types. Every matrix keeps its blocks, the
    greedy picks are transformers' argmax on the dequantized weights, and the native decode stack gives the modules'
    tokens and logprobs."""
    path = str(tmp_path / "k-quants.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q4_K, seed=5, norm_weights_near_one=True, hidden_size=256,
                    intermediate_size=512,
                    tensor_types={"blk.0.attn_v.weight": GGMLQuantizationType.Q6_K,
                                  "blk.1.ffn_down.weight": GGMLQuantizationType.Q6_K,
                                  "blk.1.ffn_up.weight": GGMLQuantizationType.Q5_K})
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    model = _model_of(llm)
    layers = model.model.layers
    q4_k, q5_k, q6_k = (GGMLQuantizationType[name].value for name in ("Q4_K", "Q5_K", "Q6_K"))
    assert [part.ggml_type for part in layers[0].self_attn.qkv_proj.gguf_parts] == [q4_k, q4_k, q6_k]
    assert [part.ggml_type for part in layers[1].mlp.gate_up_proj.gguf_parts] == [q4_k, q5_k]
    assert layers[1].mlp.down_proj.ggml_type == q6_k and layers[0].mlp.down_proj.ggml_type == q4_k
    assert model.model.embed_tokens.ggml_type == q4_k and model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(isinstance(module, LinearBase) and module.weight.dtype != torch.uint8 for module in model.modules())
    outputs = _greedy(llm)
    assert_transformers_argmax(_hf_folder_of(path, str(tmp_path / "hf")), outputs)
    modules = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128, native_decode_stack=False)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    stacked = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]
    plain = [output.outputs[0] for output in modules.generate(prompts, params, use_tqdm=False)]
    assert [output.token_ids for output in stacked] == [output.token_ids for output in plain] == outputs
    assert [output.logprobs for output in stacked] == [output.logprobs for output in plain]
    forward = model_runner_forward(llm)
    assert isinstance(forward, NativeDecodeForward) and forward.num_stack_steps > 0
    assert not isinstance(model_runner_forward(modules), NativeDecodeForward)


def test_a_parts_loader_names_a_wrong_shard_or_shape(tmp_path) -> None:
    path = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q4_1, seed=11,
                    tensor_types={"blk.0.attn_v.weight": GGMLQuantizationType.Q8_0})
    qkv = _model_of(LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)).model.layers[0].self_attn.qkv_proj
    loader = qkv.weight.weight_loader
    with pytest.raises(ValueError, match=r"shard_id='x' is not one of this layer's GGUF parts \['q', 'k', 'v'\]"):
        loader(qkv.weight, torch.zeros(1, 1, dtype=torch.uint8), "x")
    with pytest.raises(ValueError, match=r"part 'v' holds uint8 blocks \(32, 68\), the checkpoint gave "
                                         r"torch.float32 \(32, 64\)"):
        loader(qkv.weight, torch.zeros(32, 64), "v")


def test_gguf_dequantize_keeps_the_float_path(tiny_files, tmp_path) -> None:
    path = tiny_files["llama-q8_0-head"]
    dequantized = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128, gguf_dequantize=True)
    model = _model_of(dequantized)
    assert not any(isinstance(module, VocabParallelEmbedding) and module.ggml_type is not None
                   for module in model.modules())
    assert all(module.weight.dtype == torch.float32 for module in model.modules() if isinstance(module, LinearBase))
    expected = [tokens for tokens, _ in hf_greedy_with_logprobs(_hf_folder_of(path, str(tmp_path / "hf")), PROMPTS,
                                                                NUM_STEPS, 1)]
    assert _greedy(dequantized) == expected


def test_without_the_native_kernels_the_weights_load_dequantized(tiny_files, monkeypatch) -> None:
    from pagedserve.layers import gguf_linear
    from pagedserve.model_loader.model_source import open_model_source

    monkeypatch.setattr(gguf_linear, "_ops", {})
    weights = open_model_source(tiny_files["llama-q4_1"]).weights(torch.float32, keep_quantized=True)
    assert not callable(weights)
    assert all(tensor.dtype == torch.float32 for _, tensor in weights)


def test_bfloat16_model_keeps_blocks_and_computes_in_float32(tiny_files) -> None:
    path = tiny_files["llama-q4_1"]
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    assert _model_of(llm).model.embed_tokens.weight.dtype == torch.uint8
    float32 = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    # bfloat16 activations between the layers: the first token (a wide margin on this model) agrees.
    assert [tokens[0] for tokens in _greedy(llm)] == [tokens[0] for tokens in _greedy(float32)]
