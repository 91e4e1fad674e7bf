"""A worker killed mid-generation makes the engine raise promptly, and no worker process is left."""
from __future__ import annotations

from pagedserve.engine.llm_engine import LLMEngine
from worker_death_checks import kill_worker_mid_generation


def test_killed_worker_raises_promptly_and_leaves_no_process(tiny_model_dir) -> None:
    engine = LLMEngine.from_kwargs(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=64,
                                   tensor_parallel_size=2)
    executor = engine.engine_core.executor
    processes = list(executor.processes)
    try:
        kill_worker_mid_generation(engine, executor.worker_pids[1], rank=1)
    finally:
        engine.shutdown()
    for process in processes:
        process.join(10)
        assert not process.is_alive(), process.pid
