"""The feature panorama: one row per feature of SEED_FEATURES.md that this build implements.

A row appears only when the feature works. tests/test_features.py checks every row: its modules
import, its knobs are real configuration fields, its docs page exists and its tests are collected.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    line: str  # 'model' | 'framework'
    family: str  # L1 of SEED_FEATURES.md
    feature: str
    modules: tuple[str, ...]
    knobs: tuple[str, ...]  # EngineConfig.create keywords or SamplingParams fields
    docs: str
    tests: tuple[str, ...]  # pytest node ids


FEATURES: tuple[Feature, ...] = (
    Feature(
        line="framework", family="prefix cache", feature="hash-chained full-block prefix cache",
        modules=("pagedserve.core.block_pool", "pagedserve.core.block_hash", "pagedserve.core.kv_cache_manager"),
        knobs=("enable_prefix_caching",),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_prefix_caching_on_off_equal",
               "tests/core/test_kv_cache_manager.py"),
    ),
    Feature(
        line="framework", family="chunked prefill", feature="chunked prefill under one token budget",
        modules=("pagedserve.core.scheduler",),
        knobs=("enable_chunked_prefill", "max_num_batched_tokens", "long_prefill_token_threshold"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_chunked_prefill_tiny_budget_equal",
               "tests/core/test_scheduler.py"),
    ),
    Feature(
        line="framework", family="kv cache mgmt", feature="paged KV cache: block pool, KV manager, preemption",
        modules=("pagedserve.core.block_pool", "pagedserve.core.kv_cache_manager",
                 "pagedserve.worker.kv_cache_allocation", "pagedserve.attention.torch_paged"),
        knobs=("block_size", "kv_cache_memory", "num_kv_blocks", "max_num_seqs", "scheduling_policy"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_preemption_equal",
               "tests/core/test_block_pool.py", "tests/attention/test_torch_paged.py"),
    ),
    Feature(
        line="framework", family="sample", feature="sampler: greedy, temperature, top-k/p, min-p, penalties, "
                                                 "seeds, logprobs",
        modules=("pagedserve.sample.sampler", "pagedserve.sample.sampling_metadata"),
        knobs=("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "logprobs", "prompt_logprobs"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/sample/", "tests/e2e/test_sampling_e2e.py::test_seed_same_alone_and_in_batch"),
    ),
    Feature(
        line="framework", family="model_runner_v2", feature="persistent-batch model runner",
        modules=("pagedserve.worker.model_runner", "pagedserve.worker.input_batch"),
        knobs=(),
        docs="docs/architecture.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_batch_of_32_equals_alone",
               "tests/e2e/test_hf_parity.py"),
    ),
)


def render_markdown() -> str:
    lines = [
        "# Features",
        "",
        "Generated from `pagedserve/features.py` by `pagedserve features --markdown`; "
        "a row is listed only when the feature works and is tested.",
        "",
        "| line | family | feature | knobs | docs | tests |",
        "|---|---|---|---|---|---|",
    ]
    for f in FEATURES:
        knobs = ", ".join(f"`{k}`" for k in f.knobs) or "-"
        tests = "<br>".join(f"`{t}`" for t in f.tests)
        lines.append(f"| {f.line} | {f.family} | {f.feature} | {knobs} | [{f.docs}]({f.docs.removeprefix('docs/')}) "
                     f"| {tests} |")
    return "\n".join(lines) + "\n"
