"""ParallelConfig: how one model is spread over processes (TP, PP, DP, EP, fine-grained TP, DP balance).

Self-contained checks run in __post_init__; the checks that need the model (heads, KV heads, vocab,
layers) and the machine (cores / devices) run in `validate_for_model`, called by EngineConfig.create.
Every error names the knob, its value and what is allowed; impossible combinations name both knobs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DYNTRA_LB_MODES = ("dynamic", "static")


@dataclass(frozen=True)
class DyntraLBConfig:
    """DyntraLB knobs (vllm-ascend names and defaults). pagedserve builds the admission gate driven by
    `bubble_threshold` (values >= 1 are KV blocks above the mean, < 1 a ratio (max - mean) / max);
    the other fields are validated and kept for the swap planner, which is not built."""

    enabled: bool = False
    mode: str = "dynamic"
    start_step: int = 250
    end_step: int = -1
    bubble_threshold: float = 5.0
    long_req_block_threshold: int = 700
    dynamic_max_step: int = 256
    enable_diagnostics: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"dyntra_lb_config.enabled={self.enabled!r} must be a bool")
        if self.mode not in DYNTRA_LB_MODES:
            raise ValueError(f"dyntra_lb_config.mode={self.mode!r} must be one of {DYNTRA_LB_MODES}")
        if not isinstance(self.bubble_threshold, (int, float)) or not self.bubble_threshold > 0:
            raise ValueError(f"dyntra_lb_config.bubble_threshold={self.bubble_threshold!r} must be a number > 0 "
                             f"(>= 1: KV blocks above the mean; < 1: ratio (max - mean) / max)")
        for name in ("start_step", "long_req_block_threshold", "dynamic_max_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"dyntra_lb_config.{name}={value!r} must be an integer >= 0")
        if not isinstance(self.end_step, int) or self.end_step < -1:
            raise ValueError(f"dyntra_lb_config.end_step={self.end_step!r} must be an integer >= -1 (-1: no end)")

    @staticmethod
    def parse(value: "DyntraLBConfig | dict[str, Any] | str | None") -> "DyntraLBConfig":
        """From a DyntraLBConfig, a dict, a JSON object string (the CLI form) or None (defaults)."""
        if value is None:
            return DyntraLBConfig()
        if isinstance(value, DyntraLBConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"dyntra_lb_config={value!r} is not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"dyntra_lb_config={value!r} must be a dict or a JSON object string")
        allowed = {f.name for f in fields(DyntraLBConfig)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"dyntra_lb_config has unknown keys {unknown}; allowed: {sorted(allowed)}")
        return DyntraLBConfig(**value)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # None: 'uni' for a single process, else 'mp'.
    distributed_executor_backend: str | None = None
    # Fine-grained TP degrees, carved from each TP group (0: same as tensor_parallel_size).
    lmhead_tensor_parallel_size: int = 0
    embedding_tensor_parallel_size: int = 0
    oproj_tensor_parallel_size: int = 0
    enable_reduce_sample: bool = False
    enable_balance_scheduling: bool = False
    dyntra_lb_config: DyntraLBConfig = field(default_factory=DyntraLBConfig)
    # Decode context parallel (vLLM's knob): each group of this many consecutive TP ranks splits every
    # request's KV history (position p lives on the group's rank p % size); attention merges by log-sum-exp.
    decode_context_parallel_size: int = 1
    # Prefill context parallel (vLLM's knob): this many copies of the TP x PP model (added ranks) split every step's
    # tokens; their KV positions are split over them too (with DCP, over PCP x DCP ranks), merged by log-sum-exp.
    prefill_context_parallel_size: int = 1
    # Sequence parallel for TP: the residual stream split by tokens over the TP ranks, reduce-scatter / all-gather
    # instead of all-reduce around the norms (distributed/sequence_parallel.py).
    enable_sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "decode_context_parallel_size", "prefill_context_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("enable_expert_parallel", "enable_reduce_sample", "enable_balance_scheduling",
                     "enable_sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        tp = self.tensor_parallel_size
        for name in ("lmhead_tensor_parallel_size", "embedding_tensor_parallel_size",
                     "oproj_tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0 (0: same as tensor_parallel_size)")
            if value and tp % value:
                allowed = [d for d in range(1, tp + 1) if tp % d == 0]
                raise ValueError(f"{name}={value} must divide tensor_parallel_size={tp} (fine-grained groups "
                                 f"are carved from the TP group); allowed: 0 or one of {allowed}")
        dcp = self.decode_context_parallel_size
        if tp % dcp:
            allowed = [d for d in range(1, tp + 1) if tp % d == 0]
            raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp} (the "
                             f"context-parallel groups are carved from the TP group); allowed: {allowed}")
        self._check_prefill_context_parallel()
        if self.enable_sequence_parallel and tp == 1:
            raise ValueError("enable_sequence_parallel=True splits tokens over the TP ranks, but "
                             "tensor_parallel_size=1; set tensor_parallel_size >= 2 or turn it off")
        if self.enable_sequence_parallel and self.pipeline_parallel_size > 1:
            raise ValueError(f"enable_sequence_parallel=True is not supported with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} (the stages would pass token shards); use one of them")
        if self.enable_sequence_parallel and self.oproj_degree != tp:
            raise ValueError(f"enable_sequence_parallel=True needs o_proj summed over the whole TP group, but "
                             f"oproj_tensor_parallel_size={self.oproj_tensor_parallel_size}; leave it at 0")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} must be one of {EXECUTOR_BACKENDS}")
        if backend == "uni" and self.world_size_per_engine > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process but tensor_parallel_size x "
                             f"pipeline_parallel_size x prefill_context_parallel_size = {self.world_size_per_engine}; "
                             f"use 'mp' or 'ray'")
        if self.enable_reduce_sample and self.lmhead_degree == 1:
            raise ValueError("enable_reduce_sample=True needs a vocabulary-sharded LM head, but "
                             f"tensor_parallel_size={tp} / lmhead_tensor_parallel_size="
                             f"{self.lmhead_tensor_parallel_size} leave the LM head on one rank")
        if not isinstance(self.dyntra_lb_config, DyntraLBConfig):
            raise ValueError(f"dyntra_lb_config={self.dyntra_lb_config!r} must be a DyntraLBConfig "
                             f"(EngineConfig.create accepts a dict or a JSON string)")
        if self.enable_balance_scheduling and self.dyntra_lb_config.enabled:
            raise ValueError("enable_balance_scheduling=True and dyntra_lb_config.enabled=True are mutually "
                             "exclusive (two different DP admission gates); choose one")
        if self.data_parallel_size == 1 and (self.enable_balance_scheduling or self.dyntra_lb_config.enabled):
            knob = "enable_balance_scheduling" if self.enable_balance_scheduling else "dyntra_lb_config.enabled"
            raise ValueError(f"{knob}=True balances data-parallel ranks but data_parallel_size=1; "
                             f"set data_parallel_size >= 2 or turn it off")
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            # Expert all_to_all needs every EP rank in every step; our DP cores step independently (no
            # lock-step dummy batches yet), so the combination would deadlock instead of serving.
            raise ValueError(f"enable_expert_parallel=True with data_parallel_size={self.data_parallel_size} is "
                             f"not supported yet (DP ranks do not step in lock-step); use data_parallel_size=1 "
                             f"with tensor_parallel_size for the EP group")

    def _check_prefill_context_parallel(self) -> None:
        """The engine modes prefill context parallel does not cover yet, named with their knobs."""
        pcp = self.prefill_context_parallel_size
        if pcp == 1:
            return
        refused = {
            # The stages would pass token shards of different lengths between PCP ranks.
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            # Both split the token rows; one split at a time.
            "enable_sequence_parallel": self.enable_sequence_parallel,
            # The EP group would span the PCP ranks' different tokens (untested: refused, not guessed).
            "enable_expert_parallel": self.enable_expert_parallel,
        }
        for name, is_set in refused.items():
            if is_set:
                raise ValueError(f"prefill_context_parallel_size={pcp} is not supported with {name}="
                                 f"{getattr(self, name)!r} yet; set one of them back to its default")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def world_size_per_engine(self) -> int:
        """Processes one engine core drives (its executor's world): TP x PP x PCP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size

    @property
    def world_size(self) -> int:
        """Every process of the deployment: DP x PP x PCP x TP."""
        return self.data_parallel_size * self.world_size_per_engine

    @property
    def context_parallel_size(self) -> int:
        """Ranks each request's KV positions are split over: prefill_context_parallel_size x
        decode_context_parallel_size (1: no split)."""
        return self.prefill_context_parallel_size * self.decode_context_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size_per_engine == 1 else "mp"

    @property
    def lmhead_degree(self) -> int:
        return self.lmhead_tensor_parallel_size or self.tensor_parallel_size

    @property
    def embedding_degree(self) -> int:
        return self.embedding_tensor_parallel_size or self.tensor_parallel_size

    @property
    def oproj_degree(self) -> int:
        return self.oproj_tensor_parallel_size or self.tensor_parallel_size

    def kv_split_note(self) -> str:
        """For the KV capacity log line: '' without context parallel, else how many ranks split the positions and
        the world's arithmetic."""
        if self.context_parallel_size == 1:
            return ""
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        return (f" on each of {self.context_parallel_size} context-parallel ranks (prefill_context_parallel_size="
                f"{pcp} x decode_context_parallel_size={dcp}), which split the positions; world: "
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} x prefill_context_parallel_size={pcp} = {self.world_size_per_engine} "
                f"processes")

    def check_context_parallel_modes(self, is_compiled: bool, speculative_method: str | None,
                                     reads_target_hidden_states: bool, profiling_chunks: bool) -> None:
        """SP, DCP and PCP against the engine modes they do not cover (called by EngineConfig.create)."""
        if self.enable_sequence_parallel:
            if is_compiled:
                raise ValueError("enable_sequence_parallel=True runs eagerly (its token shards move in module "
                                 "hooks); set enforce_eager=True or leave compilation_config's mode unset")
            if reads_target_hidden_states:
                # EAGLE drafters call the target's embedding and read its hidden states, which SP splits by token.
                raise ValueError(f"enable_sequence_parallel=True splits the hidden states by tokens, but "
                                 f"speculative_config.method={speculative_method!r} reads the target's; turn one off")
        pcp = self.prefill_context_parallel_size
        if pcp > 1 and speculative_method is not None:
            # Verification steps would need the drafts' rows split like the prompt's and the drafter its own split.
            raise ValueError(f"prefill_context_parallel_size={pcp} does not support speculative decoding yet "
                             f"(speculative_config.method={speculative_method!r}); turn one of them off")
        if pcp > 1 and profiling_chunks:
            raise ValueError(f"profiling_chunk_config.enable=True times forwards without the context-parallel "
                             f"split, but prefill_context_parallel_size={pcp}; disable one of them")
        dcp = self.decode_context_parallel_size
        if dcp > 1 and speculative_method not in (None, "ngram"):
            # Drafters with attention layers (or block drafters writing their own caches) would need their own
            # position split and KV-head check; only the model-free ngram drafter is covered.
            raise ValueError(f"decode_context_parallel_size={dcp} supports speculative_config.method 'ngram' only, "
                             f"not {speculative_method!r}")
        if dcp > 1 and profiling_chunks:
            raise ValueError(f"profiling_chunk_config.enable=True times forwards without the context-parallel "
                             f"split, but decode_context_parallel_size={dcp}; disable one of them")

    def attention_backend_for(self, requested: str | None, batch_invariant: bool) -> str | None:
        """The attention backend the engine runs: `requested` (None: the platform's), or decode_context_parallel
        when decode_context_parallel_size or prefill_context_parallel_size > 1 (the KV positions split over ranks),
        which no other backend implements."""
        if self.context_parallel_size == 1:
            if requested == "decode_context_parallel":
                raise ValueError("attention_backend='decode_context_parallel' is chosen by "
                                 "decode_context_parallel_size > 1; with decode_context_parallel_size=1 use another")
            return requested
        knobs = self._context_parallel_knobs()
        if requested not in (None, "decode_context_parallel"):
            raise ValueError(f"attention_backend={requested!r} does not split KV positions over ranks; with "
                             f"{knobs} leave attention_backend unset")
        if batch_invariant:
            raise ValueError(f"batch_invariant=True has no context-parallel form (the ranks' partial attention is "
                             f"plain PyTorch, not the invariant kernels); with {knobs} set batch_invariant=False")
        return "decode_context_parallel"

    def _context_parallel_knobs(self) -> str:
        """The context-parallel knobs set above 1, for messages: 'decode_context_parallel_size=2' and the like."""
        return " and ".join(f"{name}={getattr(self, name)}" for name in
                            ("decode_context_parallel_size", "prefill_context_parallel_size") if getattr(self, name) > 1)

    def _validate_decode_context_parallel(self, hf_config: Any, num_kv_heads: int) -> None:
        """The attention types DCP splits: dense attention whose KV heads the group's ranks share (each rank
        attends every query head of its group over its own positions), and MLA (one latent for all heads)."""
        dcp, tp = self.decode_context_parallel_size, self.tensor_parallel_size
        if dcp == 1:
            return
        if getattr(hf_config, "kv_lora_rank", None):
            return  # MLA and DeepSeek sparse attention: every rank holds the same latent cache
        replicas = tp // num_kv_heads if tp >= num_kv_heads else 0
        if replicas == 0 or replicas % dcp:
            raise ValueError(f"decode_context_parallel_size={dcp} needs each KV head replicated on a multiple of "
                             f"{dcp} consecutive TP ranks, but tensor_parallel_size={tp} with num_key_value_heads="
                             f"{num_kv_heads} replicates each head {max(replicas, 1)} time(s); use a "
                             f"tensor_parallel_size that is a multiple of {num_kv_heads * dcp}")

    def validate_for_model(self, hf_config: Any, num_cpus: int | None, num_devices: int | None) -> None:
        """Checks that need the model and the machine (called once by EngineConfig.create)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        if num_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_attention_heads={num_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={num_kv_heads} or be a "
                             f"multiple of it (KV heads are then replicated)")
        intermediate_size = getattr(hf_config, "intermediate_size", None)
        if intermediate_size is not None and int(intermediate_size) % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size="
                             f"{intermediate_size}")
        vocab_size = int(hf_config.vocab_size)
        for name, degree in (("tensor_parallel_size", tp), ("lmhead_tensor_parallel_size", self.lmhead_degree),
                             ("embedding_tensor_parallel_size", self.embedding_degree)):
            if degree > vocab_size:
                raise ValueError(f"{name}={degree} exceeds the model's vocab_size={vocab_size}")
        self._validate_decode_context_parallel(hf_config, num_kv_heads)
        if self.prefill_context_parallel_size > 1:
            from pagedserve.distributed.prefill_context_parallel import PREFILL_CONTEXT_PARALLEL_ARCHITECTURES

            architectures = list(getattr(hf_config, "architectures", None) or [])
            if not set(architectures) & set(PREFILL_CONTEXT_PARALLEL_ARCHITECTURES):
                raise ValueError(f"prefill_context_parallel_size={self.prefill_context_parallel_size} splits "
                                 f"dense (GQA, sliding window), MLA and DeepSeek sparse attention, in the models "
                                 f"{list(PREFILL_CONTEXT_PARALLEL_ARCHITECTURES)}; the model is {architectures}")
        if self.enable_sequence_parallel:
            from pagedserve.distributed.sequence_parallel import SEQUENCE_PARALLEL_ARCHITECTURES

            architectures = list(getattr(hf_config, "architectures", None) or [])
            if not set(architectures) & set(SEQUENCE_PARALLEL_ARCHITECTURES):
                raise ValueError(f"enable_sequence_parallel=True supports {list(SEQUENCE_PARALLEL_ARCHITECTURES)}; "
                                 f"the model is {architectures}")
        num_layers = int(hf_config.num_hidden_layers)
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's num_hidden_layers={num_layers}")
        if bool(getattr(hf_config, "tie_word_embeddings", False)) and self.lmhead_degree != self.embedding_degree:
            raise ValueError(
                f"the model ties its LM head to its word embedding, so lmhead_tensor_parallel_size="
                f"{self.lmhead_tensor_parallel_size} and embedding_tensor_parallel_size="
                f"{self.embedding_tensor_parallel_size} must give the same degree")
        # Ray actors may span several machines: the Ray executor checks the cluster's resources instead.
        on_this_machine = self.executor_backend != "ray"
        if on_this_machine and num_devices is not None and self.world_size_per_engine > num_devices:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x prefill_context_parallel_size = "
                             f"{self.world_size_per_engine} exceeds the {num_devices} device(s) of this machine")
        if on_this_machine and num_cpus is not None and self.world_size > num_cpus:
            raise ValueError(f"data_parallel_size x pipeline_parallel_size x prefill_context_parallel_size x "
                             f"tensor_parallel_size = {self.world_size} processes exceed the {num_cpus} CPU core(s) "
                             f"of this machine")
