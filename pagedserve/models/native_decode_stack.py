"""The native decode stack: decode-only steps of a Llama-family model in one native call.

At batch 1 a small model's decode step is bound by memory bandwidth: every weight is read once, ~120 linear
calls of a few hundred microseconds each on SmolLM2-135M. Driving them through the modules costs ~40 Python
module calls and op dispatches per layer, as much time again as the reads. `llama_decode_stack`
(kernels/cpu/decode_stack.cpp) walks the layers in C++ and calls the same kernels in the same order with the
same arguments, so its output is bitwise that of the modules (tests/models/test_native_decode_stack.py). On
amx_packed (bfloat16), small-batch plain_native and GGUF (float32) and W8A8 int8 (either) weights a step of up to
ONE_REGION_MAX_ROWS rows runs
every layer inside one parallel region, its threads meeting at a barrier between stages instead of starting a
team for each op (decode_stack.cpp run_layers_in_one_region). When the step's requests all decode and sample
greedily with nothing else asked, the runner takes `greedy_rows` instead (`decode_rows_greedy`): one call
reads the step's inputs from the runner's persistent batch, runs the layers and the LM head's greedy pick in the
same region (bfloat16: amx_linear_first_argmax's units, sample/fused_greedy_head.py; float32: the head's
small_batch_linear units and the greedy sampler's argmax), and appends the tokens to the batch. A greedy
verification of drafts (every token of the step a decode row) takes `greedy_targets`: the layers and the head's
pick of every row in one call (`llama_decode_stack_greedy`), the acceptance then in the speculator.
After the ~275 MB weight stream of a batch-1 step every line of Python runs with cold caches (Zen 4 VM: the runner's
and engine's per-step Python took ~90 us warm, ~650 us after the stream), so the step's inputs, attention metadata,
sampler and append are not built in Python at all.

It plugs into the model runner's forward seam (`build_native_decode_forward`): the eager model stays the path
for every step the stack does not take; with compilation_config mode 'compile' the compiled graph takes every
step it covers and the stack stays off. A step takes the stack when every request in it decodes one token with no
padding rows, the attention metadata is set and grad mode is off. A model takes it when, on the CPU with the native
kernels built, it is a single-rank, single-stage Llama-family model (Llama, Mistral, Qwen2: LlamaModel with
unmodified layers, no q/k norm, a dense MLP), its norms, RoPE and activation are the native-path modules, its
attention backend is cpu_native, every linear of the layers has one of the plain, plain_native (float32), amx_packed
(bfloat16), prepacked (oneDNN), GGUF (float32) or W8A8 int8 methods, and batch_invariant is off (that mode reroutes F.linear through a dispatch
mode the native loop would bypass). Anything else keeps the modules; `native_decode_stack_plan` says why in its
`reason`.

The KV caches may be of the model's dtype or int8 pages (kv_cache_dtype="int8", attention/kv_quantization.py): with
int8 the plan also holds each layer's scale view (DecodeStackPlan.set_kv_scales) and the stack writes each new row
with reshape_and_cache_int8's quantizing code and attends with paged_decode_attention_int8's, as cpu_native does, so
the results stay bitwise the modules' (tests/models/test_native_decode_stack_int8_kv.py).

The stack skips the modules, so a step takes the modules instead while any forward hook or pre-hook is registered
(on one of the model's modules, or globally): hooks fire as they would without the stack (ForwardHookCheck looks
at the hook dicts only when a hook handle was made since it last found none). The plan holds the
parameters the layers had when it was made. Code may swap them (e.g. `restore_plain_layout`): the layers count such
assignments (layers/watched_attributes.py), and when the count moved the step checks that the layers still hold
the plan's objects (identity tests) and makes the plan again when one changed, keeping the modules from then on if
the model no longer qualifies. The op looks the tokens up in the embedding table and range-checks the positions
as the modules do (ValueError naming the position and the table's size).
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.cpu_native import DECODE_PARTITION_TOKENS, CpuNativeAttentionBackend, decode_inputs
from pagedserve.attention.kv_quantization import is_int8_kv_cache, kv_cache_scales
from pagedserve.kernels.cpu_library import is_native_extension_available, native_module
from pagedserve.attention.forward_context import get_forward_context
from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.amx_linear import AmxPackedLinearMethod
from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.forward_hooks import ForwardHookCheck, hook_registries
from pagedserve.layers.gguf_linear import GGUFLinearMethod, GGUFPartsLinearMethod
from pagedserve.layers.linear import UnquantizedLinearMethod, packed_weight_of
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.layers.small_batch_linear import SmallBatchLinearMethod, large_batches_on_onednn
from pagedserve.layers.watched_attributes import watched_attributes_epoch
from pagedserve.layers.weight_layout import OneDnnPrepackedLinearMethod
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from pagedserve.sample.fused_greedy_head import greedy_head_arguments
from pagedserve.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# linear_kind of the op, by the layers' linear method.
LINEAR_KINDS: dict[type, int] = {UnquantizedLinearMethod: 0, SmallBatchLinearMethod: 1, AmxPackedLinearMethod: 2,
                                 OneDnnPrepackedLinearMethod: 3, GGUFLinearMethod: 5, GGUFPartsLinearMethod: 5,
                                 W8A8Int8LinearMethod: 6}
# Kind 5: GGUF blocks kept quantized (float32 models only: the kernel computes in float32, as the method does).
GGUF_KIND = LINEAR_KINDS[GGUFLinearMethod]
# Kind 6: W8A8 int8 weights on the native w8a8_linear (float32 and bfloat16 models: the kernel rounds its output
# once to the model's dtype, as the method's forward does), every row count in one region.
W8A8_KIND = LINEAR_KINDS[W8A8Int8LinearMethod]
# Kind 1 off Intel: up to 128 rows on the kernel, oneDNN's GEMM above (small_batch_linear.large_batches_on_onednn).
SMALL_BATCH_ONEDNN_KIND = 4
# Decode steps of up to this many rows run the layers in one parallel region (decode_stack.cpp
# run_layers_in_one_region) on tile-packed bfloat16 weights, and on float32 weights while small_batch_linear takes
# the rows (16 on Intel, 128 elsewhere): a decode batch of up to 256 rows keeps its x in L2 in every amx_linear
# product. On the Zen 4 VM, alternating with op by op in one process: bfloat16 1.094x at 1 row, 1.084x at 2, 1.039x
# at 16, 1.047x at 64; float32 1.038x at 1 row, 1.017x at 64. Larger steps, and the other linear kinds, run op by op.
ONE_REGION_MAX_ROWS = 256
# The kv_cache_dtype values whose caches the stack writes and reads: the model's dtype, and int8 pages with their
# scales (the K/V write quantizes as reshape_and_cache_int8, the attention is paged_decode_attention_int8's code).
STACK_KV_CACHE_DTYPES = ("auto", "int8")
# The kinds whose method computes with packed_weight_of(layer).
_PACKED_KINDS = (LINEAR_KINDS[AmxPackedLinearMethod], LINEAR_KINDS[OneDnnPrepackedLinearMethod])


@dataclass
class NativeDecodeStackPlan:
    """What the stack reads that does not change between steps (handed to the op once, as `native`); `reason` says
    why a model does not qualify (then the other fields are empty)."""

    reason: str = ""
    weights: tuple[torch.Tensor, ...] = ()
    biases: tuple[torch.Tensor | None, ...] = ()
    attention_layers: tuple[nn.Module, ...] = ()
    embedding: torch.Tensor | None = None  # the token embedding table
    final_norm: torch.Tensor | None = None
    cos_sin_cache: torch.Tensor | None = None
    rotary: RotaryEmbedding | None = None  # the op checks positions against its max_positions
    output_sizes: tuple[int, ...] = ()
    sliding_windows: tuple[int, ...] = ()
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    eps: float = 0.0
    scale: float = 0.0
    linear_kind: int = 0
    # Kind 5 (GGUF): the block types of the linears (qkv, o, gate_up, down per layer), of the embedding table and of
    # the greedy head (0: a float table or head).
    weight_types: tuple[int, ...] = ()
    # ... and per linear its parts where they hold different types (int64 [P, 5]: column, columns, byte offset,
    # bytes per row, type; [0, 5] for a linear of one type), or () where no linear has parts.
    weight_parts: tuple[torch.Tensor, ...] = ()
    embedding_type: int = 0
    head_type: int = 0
    # Kind 6 (W8A8): the linears' float32 weight scales and static input scales (None: per token), 4 per layer.
    weight_scales: tuple[torch.Tensor, ...] = ()
    input_scales: tuple[torch.Tensor | None, ...] = ()
    # The LM head greedy_rows samples from (_greedy_head; None: greedy_rows is off).
    greedy_head: tuple[torch.Tensor, torch.Tensor | None, int, int] | None = None
    # watched_attributes_epoch() when the sources below were last found current.
    epoch: int = -1
    # What the fields above were read from, compared when the epoch moved (is_current): the dicts that hold the
    # attributes (a module's __dict__, _parameters or _buffers), the attributes' names and the objects they held.
    source_dicts: tuple[dict[str, Any], ...] = ()
    source_names: tuple[str, ...] = ()
    source_values: tuple[Any, ...] = ()
    # The fields above and the layers' KV caches as one torch.classes.pagedserve.DecodeStackPlan, made at the first
    # step that finds every layer's cache bound (`bind_caches`), with the caches' block size.
    native: Any = None
    block_size: int = 0
    # The persistent batch's arrays bound to `native` (bind_batch), compared by identity, and native's handle for
    # the binding's decode_rows_greedy.
    batch_arrays: tuple[torch.Tensor, ...] | None = None
    handle: int = 0

    def bind_caches(self) -> Any:
        """The native plan object, made now if it is not yet and every attention layer has its KV cache (else
        None: the step takes the modules). The op's arguments are then only the step's own tensors."""
        if self.native is None:
            kv_caches = [layer.kv_cache for layer in self.attention_layers]
            if any(cache is None for cache in kv_caches):
                return None
            self.native = torch.classes.pagedserve.DecodeStackPlan(
                list(self.weights), list(self.biases), kv_caches, self.embedding, self.final_norm,
                self.cos_sin_cache, list(self.output_sizes), list(self.sliding_windows), self.num_heads,
                self.num_kv_heads, self.head_dim, self.eps, self.scale, self.linear_kind,
                native_elementwise.REDUCTION_LANES, DECODE_PARTITION_TOKENS, ONE_REGION_MAX_ROWS)
            if self.linear_kind == GGUF_KIND:
                if self.weight_parts:
                    self.native.set_gguf_parts(list(self.weight_parts))
                self.native.set_gguf_types(list(self.weight_types), self.embedding_type, self.head_type)
            if self.linear_kind == W8A8_KIND:
                self.native.set_w8a8_scales(list(self.weight_scales), list(self.input_scales))
            if self.greedy_head is not None:
                self.native.set_greedy_head(*self.greedy_head)
            if is_int8_kv_cache(kv_caches[0]):
                # int8 pages (kv_cache_dtype="int8"): the stack writes and reads each layer's scales in place too.
                self.native.set_kv_scales([kv_cache_scales(cache) for cache in kv_caches])
            self.block_size = kv_caches[0].shape[2]
        return self.native

    def is_current(self) -> bool:
        """Whether every attribute the plan was made from still holds the same object. Compared only when a
        watched layer attribute was assigned since the last comparison (anywhere in the process: another model's
        layers move the count too)."""
        epoch = watched_attributes_epoch()
        if epoch == self.epoch:
            return True
        if not all(map(operator.is_, map(dict.get, self.source_dicts, self.source_names), self.source_values)):
            return False
        self.epoch = epoch
        return True

    @property
    def is_usable(self) -> bool:
        return not self.reason


def _linear_parts(linear: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | str:
    """(linear kind, the tensor its method computes with, bias) or why the layer does not qualify."""
    kind = LINEAR_KINDS.get(type(getattr(linear, "linear_method", None)))
    if kind is None:
        return f"{linear.prefix}: linear method {type(linear.linear_method).__name__} has no native form"
    if getattr(linear, "tp_size", 1) != 1 or getattr(linear, "gather_output", False):
        return f"{linear.prefix}: tensor parallel"
    gather_group = getattr(linear, "gather_group", None)
    if gather_group is not None and gather_group.world_size != 1:
        return f"{linear.prefix}: o_proj gathers over {gather_group.world_size} ranks"
    if kind == LINEAR_KINDS[SmallBatchLinearMethod] and large_batches_on_onednn():
        kind = SMALL_BATCH_ONEDNN_KIND
    weight = packed_weight_of(linear) if kind in _PACKED_KINDS else linear.weight
    return kind, weight, linear.bias


def _part_table(linear: nn.Module) -> torch.Tensor:
    """The plan's int64 [P, 5] table of a GGUF linear's parts (GGUFPartsLinearMethod), [0, 5] for any other."""
    parts = getattr(linear, "gguf_parts", None) or ()
    return torch.tensor([[part.row_offset, part.num_rows, part.byte_offset, part.row_bytes, part.ggml_type]
                         for part in parts], dtype=torch.int64).reshape(-1, 5)


# The attributes of the embedding, norms, rotary embedding, linears and attention layers a plan reads.
_SOURCE_ATTRIBUTES = ("weight", "bias", "packed_weight", "cos_sin_cache", "linear_method", "kv_cache",
                      "weight_scale_row", "input_scale", "gguf_parts")


def _sources(modules: list[nn.Module]) -> dict[str, tuple[Any, ...]]:
    """The plan's source_* fields for the attributes of `modules` it reads."""
    dicts, names, values = [], [], []
    for module in modules:
        for name in _SOURCE_ATTRIBUTES:
            for holder in (module._parameters, module._buffers, module.__dict__):
                if name in holder:
                    dicts.append(holder)
                    names.append(name)
                    values.append(holder[name])
                    break
    return {"source_dicts": tuple(dicts), "source_names": tuple(names), "source_values": tuple(values)}


def _is_native_norm(norm: nn.Module, dtype: torch.dtype) -> bool:
    return (type(norm) is RMSNorm and norm._forward_method == norm.forward_cpu and norm.weight.dtype == dtype
            and norm.weight.is_contiguous())


def _greedy_head(lm_head: nn.Module, linear_kind: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int] | None:
    """(weight, bias, output size, columns sampled) of an LM head the stack's region samples from as the module path
    would: tile-packed bfloat16 beside amx_packed layers (the fused head op's arguments), a plain float32 head on
    small_batch_linear beside plain_native layers, or a GGUF head beside GGUF layers (its logits, then the greedy
    sampler's argmax); beside W8A8 layers whichever of the float heads the head is (the head stays unquantized).
    None otherwise."""
    if linear_kind in (LINEAR_KINDS[AmxPackedLinearMethod], W8A8_KIND):
        head = greedy_head_arguments(lm_head)
        if head is not None or linear_kind != W8A8_KIND:
            return head
    if linear_kind == GGUF_KIND:
        if type(getattr(lm_head, "linear_method", None)) is GGUFLinearMethod and lm_head.parallel_group.world_size == 1 \
                and lm_head.vocab_start_index == 0 and (lm_head.bias is None or lm_head.bias.dtype == torch.float32):
            return lm_head.weight, lm_head.bias, lm_head.num_embeddings_per_partition, lm_head.org_vocab_size
        return None
    if linear_kind in (LINEAR_KINDS[SmallBatchLinearMethod], SMALL_BATCH_ONEDNN_KIND, W8A8_KIND) \
            and type(getattr(lm_head, "linear_method", None)) is SmallBatchLinearMethod \
            and lm_head.parallel_group.world_size == 1 and lm_head.vocab_start_index == 0 \
            and lm_head.weight.dtype == torch.float32 and lm_head.weight.is_contiguous():
        return lm_head.weight, lm_head.bias, lm_head.num_embeddings_per_partition, lm_head.org_vocab_size
    return None


def native_decode_stack_plan(model: nn.Module, dtype: torch.dtype) -> NativeDecodeStackPlan:
    """The plan for `model` (the causal LM), or one whose `reason` says why it cannot take the stack. It also holds
    the LM head for greedy_rows when the head qualifies (_greedy_head)."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, LlamaModel) or type(decoder).forward is not LlamaModel.forward:
        return NativeDecodeStackPlan(reason=f"{type(model).__name__} is not a Llama-family decoder")
    if dtype not in (torch.float32, torch.bfloat16):
        return NativeDecodeStackPlan(reason=f"dtype {dtype} (float32 and bfloat16 only)")
    if not (is_native_extension_available() and native_elementwise.native_elementwise_available()):
        return NativeDecodeStackPlan(reason="the native CPU kernels are not built")
    if not (decoder.stage.is_first and decoder.stage.is_last):
        return NativeDecodeStackPlan(reason="pipeline parallel")
    layers = list(decoder.layers)
    rotary = decoder.rotary_emb
    if type(rotary) is not RotaryEmbedding or rotary._forward_method != rotary.forward_cpu \
            or rotary.cos_sin_cache.dtype != torch.float32:
        return NativeDecodeStackPlan(reason="the rotary embedding has no native path")
    if not layers or not _is_native_norm(decoder.norm, dtype):
        return NativeDecodeStackPlan(reason="no layers or a final norm without the native path")
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    weight_types: list[int] = []
    weight_parts: list[torch.Tensor] = []
    weight_scales: list[torch.Tensor] = []
    input_scales: list[torch.Tensor | None] = []
    kinds: set[int] = set()
    epoch = watched_attributes_epoch()  # read before the sources: a change while planning makes the next check
    embed_tokens = decoder.embed_tokens
    if type(embed_tokens) is not VocabParallelEmbedding or type(embed_tokens).forward \
            is not VocabParallelEmbedding.forward or embed_tokens.tp_size != 1 \
            or embed_tokens.weight.dtype != (dtype if embed_tokens.ggml_type is None else torch.uint8):
        return NativeDecodeStackPlan(reason="the embedding is not a one-rank VocabParallelEmbedding")
    sources: list[nn.Module] = [embed_tokens, decoder.norm, rotary]
    first_attention = layers[0].self_attn
    for index, layer in enumerate(layers):
        attention, mlp = layer.self_attn, getattr(layer, "mlp", None)
        if type(layer).forward is not LlamaDecoderLayer.forward \
                or type(layer).feed_forward is not LlamaDecoderLayer.feed_forward \
                or type(attention).forward is not LlamaAttention.forward \
                or type(attention).normalize_query_key is not LlamaAttention.normalize_query_key \
                or type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul \
                or mlp.act_fn._forward_method != mlp.act_fn.forward_cpu:
            return NativeDecodeStackPlan(reason=f"layer {index} is not a plain Llama layer")
        if not (_is_native_norm(layer.input_layernorm, dtype) and _is_native_norm(layer.post_attention_layernorm,
                                                                                  dtype)):
            return NativeDecodeStackPlan(reason=f"layer {index}: a norm without the native path")
        if type(attention.attn.backend) is not CpuNativeAttentionBackend:
            return NativeDecodeStackPlan(reason=f"layer {index}: attention backend {attention.attn.backend.name}")
        if attention.rotary_emb is not rotary or (attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                                  attention.attn.scale) != (
                first_attention.num_heads, first_attention.num_kv_heads, first_attention.head_dim,
                first_attention.attn.scale) \
                or layer.input_layernorm.variance_epsilon != decoder.norm.variance_epsilon \
                or layer.post_attention_layernorm.variance_epsilon != decoder.norm.variance_epsilon:
            return NativeDecodeStackPlan(reason=f"layer {index}: shapes or constants differ from layer 0's")
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_linear_parts(linear) for linear in linears]
        for part in parts:
            if isinstance(part, str):
                return NativeDecodeStackPlan(reason=part)
        (qkv_kind, qkv, qkv_bias), (o_kind, o, o_bias), (gu_kind, gate_up, gu_bias), (d_kind, down, d_bias) = parts
        kinds.update((qkv_kind, o_kind, gu_kind, d_kind))
        weight_types += [getattr(linear, "ggml_type", None) or 0 for linear in linears]
        weight_parts += [_part_table(linear) for linear in linears]
        if {qkv_kind, o_kind, gu_kind, d_kind} == {W8A8_KIND}:  # mixed methods are refused below
            weight_scales += [linear.weight_scale_row for linear in linears]
            input_scales += [linear.input_scale if linear.linear_method.is_static_input else None
                             for linear in linears]
        sources += [layer.input_layernorm, layer.post_attention_layernorm, *linears, attention.attn]
        weights += [layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down]
        biases += [qkv_bias, o_bias, gu_bias, d_bias]
    if len(kinds) != 1:
        return NativeDecodeStackPlan(reason="the layers' linears use different methods")
    linear_kind = kinds.pop()
    if linear_kind == GGUF_KIND and dtype != torch.float32:
        # The kernel computes in float32 between bfloat16 activations in the module path; the stack's region would
        # keep float32 activations: not the modules' bits.
        return NativeDecodeStackPlan(reason="GGUF blocks in a bfloat16 model (the stack runs them in float32 only)")
    if embed_tokens.ggml_type is not None and linear_kind != GGUF_KIND:
        return NativeDecodeStackPlan(reason="a GGUF-quantized embedding beside float linears")
    lm_head = getattr(model, "lm_head", None)
    greedy_head = None if lm_head is None else _greedy_head(lm_head, linear_kind)
    if greedy_head is not None:
        sources.append(lm_head)
    mlp = layers[0].mlp
    return NativeDecodeStackPlan(
        weights=tuple(weights), biases=tuple(biases),
        attention_layers=tuple(layer.self_attn.attn for layer in layers), embedding=embed_tokens.weight,
        final_norm=decoder.norm.weight, cos_sin_cache=rotary.cos_sin_cache, rotary=rotary,
        output_sizes=(first_attention.qkv_proj.output_size_per_partition,
                      first_attention.o_proj.output_size_per_partition,
                      mlp.gate_up_proj.output_size_per_partition, mlp.down_proj.output_size_per_partition),
        sliding_windows=tuple(layer.self_attn.attn.sliding_window or 0 for layer in layers),
        num_heads=first_attention.num_heads, num_kv_heads=first_attention.num_kv_heads,
        head_dim=first_attention.head_dim, eps=float(decoder.norm.variance_epsilon),
        scale=float(first_attention.attn.scale), linear_kind=linear_kind, weight_types=tuple(weight_types),
        weight_parts=tuple(weight_parts) if any(len(table) for table in weight_parts) else (),
        embedding_type=embed_tokens.ggml_type or 0,
        head_type=(getattr(lm_head, "ggml_type", None) or 0) if greedy_head is not None else 0,
        weight_scales=tuple(weight_scales), input_scales=tuple(input_scales),
        greedy_head=greedy_head, epoch=epoch,
        **_sources(sources))


class NativeDecodeForward:
    """The runner's forward: decode-only steps on `llama_decode_stack`, every other step on `fallback`; and
    `greedy_rows`, a greedy decode step of the runner's persistent batch in one call."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, plan: NativeDecodeStackPlan,
                 fallback: Callable[..., Any]) -> None:
        assert plan.is_usable, plan.reason
        self.model = model
        self.dtype = dtype
        self.plan: NativeDecodeStackPlan | None = plan
        self.fallback = fallback
        self.op = torch.ops.pagedserve.llama_decode_stack.default
        self.greedy_op = torch.ops.pagedserve.llama_decode_stack_greedy.default
        # greedy_rows' step, the library's Python binding: the plan by handle, rows and tokens as lists.
        self.decode_rows_greedy = native_module().decode_rows_greedy
        # The runner's persistent batch as greedy_rows hands it to the plan (bind_batch).
        self.batch_arrays: tuple[torch.Tensor, ...] | None = None
        self.batch_block_size = 0
        self.has_hooks = self._hook_check()
        self.num_stack_steps = 0
        self.num_greedy_steps = 0  # of num_stack_steps, those that also sampled (greedy_rows)

    def _hook_check(self) -> ForwardHookCheck:
        """Whether a forward hook or pre-hook would fire in the modules' forward: globally, on the model or on any
        module its decoder holds (the LM head is applied outside the forward, by the runner)."""
        return ForwardHookCheck(hook_registries((self.model, *self.model.model.modules())))

    def current_plan(self) -> NativeDecodeStackPlan | None:
        """The plan, made again when a layer no longer holds what it was made from (None: the model no longer
        qualifies; the modules take every step from then on)."""
        plan = self.plan
        if plan is not None and not plan.is_current():
            has_run = plan.native is not None  # else the KV caches were bound after planning, as at every start
            plan = native_decode_stack_plan(self.model, self.dtype)
            if plan.is_usable:
                (logger.info if has_run else logger.debug)(
                    "native decode stack: the layers' parameters or KV caches changed; plan made again")
                self.has_hooks = self._hook_check()  # modules may have been replaced too
            else:
                logger.info("native decode stack: no longer used (%s)", plan.reason)
                plan = None
            self.plan = plan
        return plan

    def _stack_arguments(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[Any, ...] | None:
        """The stack op's arguments when this step takes the stack (every request decodes one token, no padding
        rows, attention metadata set, grad mode off, the model still qualifies, no hooks, the caches bound), else
        None."""
        metadata = get_forward_context().attn_metadata
        num_tokens = input_ids.shape[0]
        if metadata is None or torch.is_grad_enabled() or not (
                0 < num_tokens == metadata.num_actual_tokens == metadata.num_decodes == metadata.num_seqs):
            return None
        plan = self.current_plan()
        if plan is None or self.has_hooks():
            return None
        native = plan.bind_caches()
        if native is None or plan.block_size != metadata.block_size:
            return None  # the modules raise the error that names the cause
        block_table, seq_lens = decode_inputs(metadata)
        return (native, input_ids, positions, block_table, seq_lens, metadata.slot_mapping[:num_tokens],
                plan.rotary.max_positions)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        arguments = None if args or kwargs else self._stack_arguments(input_ids, positions)
        if arguments is None:
            return self.fallback(input_ids, positions, *args, **kwargs)
        hidden_states = self.op(*arguments)
        self.num_stack_steps += 1
        return hidden_states

    def greedy_targets(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step's forward (every token a decode row, as __call__ takes it) and the LM head's greedy pick of every
        row: int64 [num tokens], first_argmax of the module path's logits bit for bit. None, with nothing run, when
        the stack does not take the step, the plan has no head, or a float32 step is too large for the one region
        (the caller then runs the forward and the head itself)."""
        arguments = self._stack_arguments(input_ids, positions)
        if arguments is None or self.plan is None or self.plan.greedy_head is None:
            return None
        token_ids = self.greedy_op(*arguments)
        if token_ids.numel() == 0:
            return None
        self.num_stack_steps += 1
        self.num_greedy_steps += 1
        return token_ids

    def bind_batch(self, batch: InputBatch) -> None:
        """Share the runner's persistent batch arrays (their memory) with greedy_rows' op."""
        self.batch_arrays = tuple(torch.from_numpy(array) for array in (
            batch.token_ids, batch.num_tokens, batch.num_computed_tokens, batch.block_table, batch.num_blocks))
        self.batch_block_size = batch.block_size

    def greedy_rows(self, rows: list[int], allowed: torch.Tensor | None = None) -> list[int] | None:
        """Decode rows `rows` of the bound batch, each its last token at position num_computed_tokens, sample each
        row's next token greedily (first_argmax of the LM head's logits, the module path's pick bit for bit) and
        append it to the batch: the token ids. None when the step does not take the stack (hooks, the model no
        longer qualifies, the caches not bound), the plan has no head, a float32 step is too large for the one
        region, or a row's next token is not sampled (a one-token prefill chunk); nothing has changed then, and the
        runner builds the step itself. The caller checks that the sampler would take nothing but the argmax
        (fused_greedy_head.is_plain_greedy). `allowed` (structured outputs): int32 [len(rows), words], each row's
        grammar bitmask; the pick is then the first argmax of the masked logits (disallowed tokens -inf)."""
        if self.batch_arrays is None or torch.is_grad_enabled():
            return None
        plan = self.current_plan()
        if plan is None or plan.greedy_head is None or self.has_hooks():
            return None
        native = plan.bind_caches()
        if native is None or plan.block_size != self.batch_block_size:
            return None
        if plan.batch_arrays is not self.batch_arrays:
            native.bind_batch(*self.batch_arrays)
            plan.batch_arrays = self.batch_arrays
            plan.handle = native.handle()
        # By handle, without the dispatcher (decode_stack.cpp PlanRegistry): `native` lives as long as the plan,
        # which holds it.
        token_ids = self.decode_rows_greedy(plan.handle, rows, plan.rotary.max_positions, allowed)
        if not token_ids:
            return None
        self.num_stack_steps += 1
        self.num_greedy_steps += 1
        return token_ids


def build_native_decode_forward(model: nn.Module, engine_config: Any, forward: Callable[..., Any],
                                device: torch.device) -> Callable[..., Any]:
    """`forward` (the eager model) wrapped so decode-only steps take the native stack, when the engine enables
    it, runs eagerly on one CPU rank and the model qualifies (logged either way); `forward` itself otherwise."""
    if not engine_config.native_decode_stack or device.type != "cpu" or engine_config.batch_invariant \
            or engine_config.parallel_config.world_size_per_engine > 1:
        return forward
    if engine_config.compilation_config.is_compiled:
        return forward  # compilation_config asked for the compiled graph on every step it covers
    dtype = engine_config.model_config.dtype
    plan = native_decode_stack_plan(model, dtype)
    if plan.is_usable and engine_config.cache_config.kv_cache_dtype not in STACK_KV_CACHE_DTYPES:
        plan = NativeDecodeStackPlan(reason=f"kv_cache_dtype={engine_config.cache_config.kv_cache_dtype!r}")
    if not plan.is_usable:
        logger.info("native decode stack: not used (%s)", plan.reason)
        return forward
    logger.info("native decode stack: decode-only steps run %d layers in one native call%s",
                len(plan.sliding_windows), ", greedy ones with the LM head's argmax" if plan.greedy_head else "")
    return NativeDecodeForward(model, dtype, plan, forward)


__all__ = ["LINEAR_KINDS", "NativeDecodeForward", "NativeDecodeStackPlan", "build_native_decode_forward",
           "native_decode_stack_plan"]
