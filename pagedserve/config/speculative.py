"""SpeculativeConfig: speculative decoding knobs, with vLLM's / vllm-ascend's names.

`speculative_config` is given to EngineConfig.create / LLM(...) as a dict (or JSON text on the command line):
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
     "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 32, 2], [33, 1024, 0]],
     "rejection_sampler_config": {"enable_block_verify": false, "enable_entropy_verify": false,
                                  "posterior_threshold": 0.95, "posterior_alpha": 0.4}}
Each step a proposer (spec_decode/) drafts up to `num_speculative_tokens` tokens per request, the target
model scores them all in one forward, and the rejection sampler keeps the longest verified prefix plus one
token of its own, so the output is distributed as without speculation (greedy: identical), except with
entropy verify, which is lossy by design.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.config.knob_dict import config_from_dict

logger = logging.getLogger(__name__)

# Every method the specification names (all implemented).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark")
# Methods that run a drafter network with KV caches of its own.
DRAFTER_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark")
# Drafters that read the target's hidden states (spec_decode/hidden_state_proposer.py, block_draft_proposer.py).
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")
# Drafters that propose a whole block in one forward, with confidences (spec_decode/block_draft_proposer.py).
BLOCK_DRAFT_METHODS = ("dflash", "dspark")
# Drafters that run one forward per draft and write their KV at the draft positions (lookahead slots).
AUTOREGRESSIVE_DRAFTER_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Drafters given as a folder of their own (mtp's layers are in the target's checkpoint).
FOLDER_DRAFTER_METHODS = ("draft_model", "eagle", "eagle3", "dflash", "dspark")
# draft_sample_method values: 'probabilistic' (sampled requests sample their drafts) only for a draft model.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
MAX_NUM_SPECULATIVE_TOKENS = 16
# Block verification accepts past an individual failure, which pays only over blocks of 3 or more drafts.
MIN_BLOCK_VERIFY_TOKENS = 3


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RejectionSamplerConfig:
    """How drafts are verified (spec_decode/rejection_sampler.py)."""

    # Accept the longest prefix passing a block-wise test (lossless; accepts past a single failure).
    enable_block_verify: bool = False
    # Lower the acceptance threshold by the target's entropy: LOSSY, trades fidelity for accepted tokens.
    enable_entropy_verify: bool = False
    # Entropy verify: the threshold is min(exp(-posterior_alpha * entropy), posterior_threshold).
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4

    def __post_init__(self) -> None:
        for name in ("enable_block_verify", "enable_entropy_verify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"rejection_sampler_config.{name}={getattr(self, name)!r} must be true or false")
        if not _is_number(self.posterior_threshold) or not 0 < self.posterior_threshold <= 1:
            raise ValueError(f"rejection_sampler_config.posterior_threshold={self.posterior_threshold!r} must be "
                             f"in (0, 1]")
        if not _is_number(self.posterior_alpha) or not self.posterior_alpha >= 0:
            raise ValueError(f"rejection_sampler_config.posterior_alpha={self.posterior_alpha!r} must be >= 0")

    @staticmethod
    def parse(value: "RejectionSamplerConfig | dict[str, Any] | str | None") -> "RejectionSamplerConfig":
        if value is None:
            return RejectionSamplerConfig()
        if isinstance(value, RejectionSamplerConfig):
            return value
        return config_from_dict(RejectionSamplerConfig, "rejection_sampler_config", value)


@dataclass(frozen=True)
class DynamicSpecConfig:
    """Per-request verify lengths from a block drafter's confidences (spec_decode/dynamic_spec_scheduler.py)."""

    # 'dspark': the DSpark drafter's confidence head; 'dflash': each draft's top softmax probability.
    method: str | None = None
    # DynamicSpecParams' knobs (initial_verify_budget_per_req, budget_update_interval, budget_threshold,
    # min_verify_tokens); None: their defaults.
    method_params: Any = None

    def __post_init__(self) -> None:
        if self.method not in BLOCK_DRAFT_METHODS:
            raise ValueError(f"speculative_config.dynamic_spec_config.method={self.method!r} must be one of "
                             f"{list(BLOCK_DRAFT_METHODS)}")
        from pagedserve.spec_decode.dynamic_spec_scheduler import DynamicSpecParams

        if not isinstance(self.method_params, DynamicSpecParams):
            object.__setattr__(self, "method_params", DynamicSpecParams.from_dict(self.method_params))

    @staticmethod
    def parse(value: "DynamicSpecConfig | dict[str, Any] | str | None") -> "DynamicSpecConfig | None":
        if value is None or isinstance(value, DynamicSpecConfig):
            return value
        return config_from_dict(DynamicSpecConfig, "speculative_config.dynamic_spec_config", value)


@dataclass(frozen=True)
class BatchSizeRange:
    """Batches of min_batch_size..max_batch_size running requests draft num_speculative_tokens tokens each."""

    min_batch_size: int
    max_batch_size: int
    num_speculative_tokens: int


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    # The drafter (draft_model, eagle, eagle3, dflash, dspark): an HF folder. mtp: None (or the target's folder),
    # the MTP layers being in the target's checkpoint.
    model: str | None = None
    # ngram: the longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max, found earlier in the
    # request's tokens proposes the tokens that followed it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # [[lo, hi, K], ...]: K drafts per request while lo <= running requests <= hi (K = 0: no speculation);
    # batch sizes no range covers use num_speculative_tokens.
    num_speculative_tokens_per_batch_size: tuple[BatchSizeRange, ...] = ()
    rejection_sampler_config: RejectionSamplerConfig = field(default_factory=RejectionSamplerConfig)
    # dflash / dspark: per-request verify lengths from the drafts' confidences (DynamicSpecConfig).
    dynamic_spec_config: DynamicSpecConfig | dict[str, Any] | None = None
    # 'greedy' (drafts are the drafter's argmax) or 'probabilistic' (draft_model only: sampled requests sample
    # their drafts from the drafter's distribution); None: probabilistic for draft_model, greedy for the others.
    draft_sample_method: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:  # speculation off: nothing else may be set
            set_knobs = [f.name for f in fields(self) if f.name != "method" and getattr(self, f.name) not in
                         (None, (), RejectionSamplerConfig())]
            if set_knobs:
                raise ValueError(f"speculative_config sets {set_knobs} but no method; set speculative_config.method "
                                 f"to one of {list(SPECULATIVE_METHODS)}")
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} must be one of {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer in "
                             f"[1, {MAX_NUM_SPECULATIVE_TOKENS}]")
        self._check_ngram()
        if self.model is not None and self.method == "ngram":
            raise ValueError(f"speculative_config.model={self.model!r} is not used by method 'ngram' (it drafts "
                             f"from the request's own tokens); remove it")
        if self.method in FOLDER_DRAFTER_METHODS and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.method={self.method!r} needs speculative_config.model: the "
                             f"drafter's HF folder (got {self.model!r})")
        object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                           _parse_batch_size_ranges(self.num_speculative_tokens_per_batch_size, k))
        if self.method == "dspark" and self.num_speculative_tokens_per_batch_size:
            raise ValueError("speculative_config.num_speculative_tokens_per_batch_size is not supported with method "
                             "'dspark' (its block size is fixed; dynamic_spec_config varies what is verified)")
        object.__setattr__(self, "rejection_sampler_config",
                           RejectionSamplerConfig.parse(self.rejection_sampler_config))
        verify = self.rejection_sampler_config
        if verify.enable_block_verify and k < MIN_BLOCK_VERIFY_TOKENS:
            raise ValueError(f"rejection_sampler_config.enable_block_verify=true needs "
                             f"speculative_config.num_speculative_tokens >= {MIN_BLOCK_VERIFY_TOKENS}, got {k}")
        if verify.enable_entropy_verify:
            logger.warning("rejection_sampler_config.enable_entropy_verify=true is lossy: sampled outputs are no "
                           "longer distributed as the target model's (greedy requests are unaffected)")
        self._check_draft_sampling()
        self._check_dynamic_spec()

    def _check_draft_sampling(self) -> None:
        value = self.draft_sample_method
        if value is None:
            return
        if value not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method={value!r} must be one of "
                             f"{list(DRAFT_SAMPLE_METHODS)}")
        if value == "probabilistic" and self.method != "draft_model":
            detail = "DSpark drafts greedily only" if self.method == "dspark" else "its drafts are the drafter's argmax"
            raise ValueError(f"speculative_config.draft_sample_method='probabilistic' is not supported with method "
                             f"{self.method!r} ({detail}); use 'greedy' or leave it unset")

    def _check_dynamic_spec(self) -> None:
        if self.dynamic_spec_config is None:
            return
        if self.method not in BLOCK_DRAFT_METHODS:
            raise ValueError(f"speculative_config.dynamic_spec_config applies to methods {list(BLOCK_DRAFT_METHODS)} "
                             f"(drafters with confidences), not {self.method!r}")
        dynamic = DynamicSpecConfig.parse(self.dynamic_spec_config)
        assert dynamic is not None
        object.__setattr__(self, "dynamic_spec_config", dynamic)
        if dynamic.method == "dspark" and self.method != "dspark":
            raise ValueError(f"speculative_config.dynamic_spec_config.method='dspark' reads a DSpark drafter's "
                             f"confidence head; method {self.method!r} has none (use 'dflash')")
        if self.num_speculative_tokens_per_batch_size:
            raise ValueError("speculative_config.dynamic_spec_config and num_speculative_tokens_per_batch_size both "
                             "choose how many drafts to verify: set one of them")
        min_verify = dynamic.method_params.min_verify_tokens
        if min_verify > self.num_speculative_tokens:
            raise ValueError(f"speculative_config.dynamic_spec_config.method_params.min_verify_tokens={min_verify} "
                             f"must be <= num_speculative_tokens={self.num_speculative_tokens}")

    def _check_ngram(self) -> None:
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lookup_min is not None or lookup_max is not None:
                raise ValueError(f"speculative_config.prompt_lookup_min/max apply to method 'ngram' only, not "
                                 f"{self.method!r}")
            return
        # vLLM's defaults: one bound given sets the other; neither gives 5..5.
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = 5
        lookup_min = lookup_max if lookup_min is None else lookup_min
        lookup_max = lookup_min if lookup_max is None else lookup_max
        for name, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an integer >= 1")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={lookup_min} must be <= "
                             f"prompt_lookup_max={lookup_max}")
        object.__setattr__(self, "prompt_lookup_min", lookup_min)
        object.__setattr__(self, "prompt_lookup_max", lookup_max)

    @property
    def is_enabled(self) -> bool:
        return self.method is not None

    @property
    def reads_target_hidden_states(self) -> bool:
        """The drafter reads the target's hidden states every step (no fused greedy decode for the target)."""
        return self.method in HIDDEN_STATE_METHODS

    @property
    def reads_target_layers(self) -> bool:
        """The drafter reads hidden states inside the target (EAGLE-3, DFlash, DSpark): the target runs eagerly."""
        return self.method in ("eagle3", *BLOCK_DRAFT_METHODS)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past each step's tokens: a drafter writes its drafts' KV there."""
        return (self.num_speculative_tokens or 0) if self.method in AUTOREGRESSIVE_DRAFTER_METHODS else 0

    def num_tokens_for_batch_size(self, batch_size: int) -> int:
        """Drafts per request for a step of `batch_size` requests (the batch-size table, else the default)."""
        for batch_range in self.num_speculative_tokens_per_batch_size:
            if batch_range.min_batch_size <= batch_size <= batch_range.max_batch_size:
                return batch_range.num_speculative_tokens
        return self.num_speculative_tokens or 0

    def check_drafter(self, target_hf_config: Any, target_tokenizer: str | None, max_model_len: int,
                      target_model: str | None = None) -> None:
        """The drafter must exist and fit the target: a draft model shares its vocabulary and tokenizer (drafts
        are target token ids) and reaches max_model_len positions; an EAGLE / EAGLE-3 drafter matches the
        target's vocabulary and hidden size; mtp needs a target whose checkpoint carries MTP layers."""
        if self.method == "mtp":
            self._check_mtp_target(target_hf_config, target_model)
            return
        if self.method not in FOLDER_DRAFTER_METHODS:
            return
        tokenizer_path: str | None = None
        if self.method == "draft_model":
            from pagedserve.model_loader.model_source import open_model_source

            try:
                source = open_model_source(self.model)
            except (ValueError, OSError) as error:
                raise ValueError(f"speculative_config.model={self.model!r}: {error}") from None
            drafter_config, tokenizer_path = source.hf_config, source.tokenizer_path
        else:
            from pagedserve.spec_decode.drafter_loading import checkpoint_files, drafter_hf_config

            drafter_config = drafter_hf_config(self.model)
            checkpoint_files(self.model)
        drafter_vocab, target_vocab = drafter_config.vocab_size, target_hf_config.vocab_size
        if drafter_vocab != target_vocab:
            raise ValueError(f"speculative_config.model={self.model!r} has vocab_size={drafter_vocab}, the target "
                             f"model {target_vocab}: the drafter must share the target's tokenizer")
        from pagedserve.config.model import derived_max_model_len

        drafter_limit = derived_max_model_len(drafter_config)
        if drafter_limit < max_model_len:
            raise ValueError(f"speculative_config.model={self.model!r} handles {drafter_limit} positions, fewer than "
                             f"max_model_len={max_model_len}: set max_model_len <= {drafter_limit} or use another "
                             f"drafter")
        if self.method in HIDDEN_STATE_METHODS:
            hidden_size = getattr(drafter_config, "target_hidden_size", None) or drafter_config.hidden_size
            if hidden_size != target_hf_config.hidden_size:
                raise ValueError(f"speculative_config.model={self.model!r} reads hidden states of size {hidden_size}, "
                                 f"the target model's are {target_hf_config.hidden_size}: it was trained for "
                                 f"another target")
            return
        if target_tokenizer is not None and tokenizer_path is not None and \
                _tokenizer_vocabulary(tokenizer_path) != _tokenizer_vocabulary(target_tokenizer):
            raise ValueError(f"speculative_config.model={self.model!r}: its tokenizer ({tokenizer_path}) "
                             f"maps tokens to other ids than the target's ({target_tokenizer}); the drafter must "
                             f"share the target's tokenizer")

    def _check_mtp_target(self, target_hf_config: Any, target_model: str | None) -> None:
        import os

        from pagedserve.models.multi_token_predictor import MTP_ARCHITECTURES, num_mtp_layers

        if self.model is not None and (target_model is None or
                                       os.path.realpath(self.model) != os.path.realpath(target_model)):
            raise ValueError(f"speculative_config.model={self.model!r}: method 'mtp' runs the target's own MTP "
                             f"layers; leave model unset (or the target's folder {target_model!r})")
        architectures = getattr(target_hf_config, "architectures", None) or []
        if not architectures or architectures[0] not in MTP_ARCHITECTURES:
            raise ValueError(f"speculative_config.method='mtp' needs a target with multi-token-prediction layers "
                             f"({list(MTP_ARCHITECTURES)}); the target is {architectures[:1]}")
        if num_mtp_layers(target_hf_config) < 1:
            raise ValueError("speculative_config.method='mtp': the target's config has num_nextn_predict_layers=0 "
                             "(its checkpoint carries no MTP layers)")
        if target_model is None or not os.path.isdir(target_model):
            raise ValueError(f"speculative_config.method='mtp' reads the MTP layers from the target's HF folder; "
                             f"the target {target_model!r} is not one")

    def check_engine(self, *, async_scheduling: bool, pipeline_parallel_size: int,
                     enable_reduce_sample: bool = False) -> None:
        """The rules between speculation and the rest of the engine."""
        if not self.is_enabled:
            return
        if async_scheduling:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported with "
                             f"async_scheduling=True (the next step's drafts depend on the tokens this step "
                             f"accepts): set async_scheduling=False or remove speculative_config")
        if pipeline_parallel_size > 1:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported with "
                             f"pipeline_parallel_size={pipeline_parallel_size} (verification needs the tokens on "
                             f"every stage): use pipeline_parallel_size=1 or remove speculative_config")
        if enable_reduce_sample:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported with "
                             f"enable_reduce_sample=True (verification needs every position's full distribution): "
                             f"set enable_reduce_sample=False or remove speculative_config")

    @staticmethod
    def parse(value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict, JSON object text (the CLI flag) or None (off)."""
        if value is None:
            return SpeculativeConfig()
        if isinstance(value, SpeculativeConfig):
            return value
        return config_from_dict(SpeculativeConfig, "speculative_config", value)


def _tokenizer_vocabulary(path: str) -> dict[str, int] | None:
    """The token -> id map of the tokenizer files in folder `path`; None when it has none (nothing to compare)."""
    import os

    if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, name)) for name in
                                          ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()


def _parse_batch_size_ranges(value: Any, num_speculative_tokens: int) -> tuple[BatchSizeRange, ...]:
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}={value!r} must be a list of [min_batch_size, max_batch_size, K] triples")
    ranges: list[BatchSizeRange] = []
    for entry in value:
        if isinstance(entry, BatchSizeRange):
            entry = (entry.min_batch_size, entry.max_batch_size, entry.num_speculative_tokens)
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(_is_int(v) for v in entry):
            raise ValueError(f"{name} entry {entry!r} must be [min_batch_size, max_batch_size, K], three integers")
        lo, hi, k = entry
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} entry {list(entry)}: the batch sizes must satisfy 1 <= {lo} <= {hi}")
        if not 0 <= k <= num_speculative_tokens:
            raise ValueError(f"{name} entry {list(entry)}: K={k} must be in [0, num_speculative_tokens="
                             f"{num_speculative_tokens}] (0 turns speculation off for those batch sizes)")
        for other in ranges:
            if lo <= other.max_batch_size and other.min_batch_size <= hi:
                raise ValueError(f"{name} entries {list(entry)} and {[other.min_batch_size, other.max_batch_size]}"
                                 f" overlap")
        ranges.append(BatchSizeRange(lo, hi, k))
    return tuple(sorted(ranges, key=lambda r: r.min_batch_size))


__all__ = ["SpeculativeConfig", "RejectionSamplerConfig", "DynamicSpecConfig", "BatchSizeRange", "SPECULATIVE_METHODS",
           "DRAFTER_METHODS", "HIDDEN_STATE_METHODS", "BLOCK_DRAFT_METHODS"]
