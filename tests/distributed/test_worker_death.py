"""A worker killed mid-generation makes the engine raise promptly, and no worker process is left."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.abstract import FatalExecutorError


def test_killed_worker_raises_promptly_and_leaves_no_process(tiny_model_dir) -> None:
    engine = LLMEngine.from_kwargs(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=64,
                                   tensor_parallel_size=2)
    executor = engine.engine_core.executor
    processes = list(executor.processes)
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(10, 40))},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(FatalExecutorError, match="rank 1"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 10.0
        # Later steps keep failing loudly instead of hanging.
        with pytest.raises(FatalExecutorError):
            engine.step()
    finally:
        engine.shutdown()
    for process in processes:
        process.join(10)
        assert not process.is_alive(), process.pid
