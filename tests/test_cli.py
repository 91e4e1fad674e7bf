"""The `pagedserve` command."""
from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_json_matches_llm(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    result = _run("generate", "--model", folder, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0",
                  "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "256", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    from pagedserve import LLM, SamplingParams

    expected = LLM(folder, num_kv_blocks=64, max_model_len=256).generate("Hello", SamplingParams(temperature=0, max_tokens=6,
                                                                              ignore_eos=True), use_tqdm=False)
    assert record["outputs"][0]["token_ids"] == expected[0].outputs[0].token_ids
    assert record["outputs"][0]["finish_reason"] == "length"


def test_generate_reads_stdin_and_reports_bad_input(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    ok = _run("generate", "--model", folder, "--max-tokens", "3", "--num-kv-blocks", "64", "--max-model-len", "256", stdin="Hi there")
    assert ok.returncode == 0, ok.stderr
    bad = _run("generate", "--model", folder, "--prompt", "x", "--top-p", "2", "--num-kv-blocks", "64", "--max-model-len", "256")
    assert bad.returncode == 2
    assert "top_p=2.0" in bad.stderr


def test_features_lists_rows() -> None:
    result = _run("features")
    assert result.returncode == 0
    assert "prefix cache" in result.stdout and "chunked prefill" in result.stdout


def test_chat_with_the_default_model_answers_paris() -> None:
    result = _run("chat", "--temperature", "0", "--max-tokens", "40", "--max-model-len", "1024",
                  stdin="What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stdout.strip() == result.stdout.strip().splitlines()[-1]  # only the answer is printed


def test_chat_rejects_an_empty_message(tiny_model_dir) -> None:
    result = _run("chat", "--model", tiny_model_dir("llama"), "--num-kv-blocks", "64", "--max-model-len", "256",
                  stdin="   ")
    assert result.returncode == 2
    assert "empty" in result.stderr


def test_parsing_the_command_line_imports_no_torch() -> None:
    code = ("import sys, pagedserve, pagedserve.cli; pagedserve.cli.build_parser().parse_args(['chat']); "
            "assert 'torch' not in sys.modules; from pagedserve import LLM, SamplingParams, EngineConfig; "
            "from pagedserve.config import ModelConfig; assert 'torch' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_start_up_pauses_the_collector_then_freezes_what_it_made() -> None:
    import gc

    from pagedserve.cli import _start_up

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with _start_up():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()
