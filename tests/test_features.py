"""The feature panorama registry: every row's modules, knobs, docs and tests are real."""
from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

from pagedserve.config.engine import engine_kwargs_names
from pagedserve.features import FEATURES, render_markdown
from pagedserve.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_modules_import() -> None:
    for feature in FEATURES:
        for module in feature.modules:
            importlib.import_module(module)


def test_knobs_are_config_fields() -> None:
    fields = set(engine_kwargs_names()) | {f.name for f in dataclasses.fields(SamplingParams)}
    for feature in FEATURES:
        for knob in feature.knobs:
            assert knob in fields, f"{feature.feature}: knob {knob!r} is not a config field"


def test_docs_exist_and_features_md_is_current() -> None:
    for feature in FEATURES:
        assert os.path.isfile(os.path.join(ROOT, feature.docs)), feature.docs
    with open(os.path.join(ROOT, "docs", "features.md")) as f:
        assert f.read() == render_markdown(), "docs/features.md is stale: run `pagedserve features --markdown`"


def test_named_tests_are_collected() -> None:
    node_ids = sorted({node for feature in FEATURES for node in feature.tests})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *node_ids],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = result.stdout
    for node in node_ids:
        assert node.rstrip("/") in collected, f"{node} was not collected"
