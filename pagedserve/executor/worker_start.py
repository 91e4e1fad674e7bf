"""How the 'mp' executor starts its worker processes: forks of a fork server that has imported the worker's modules.

A spawned worker imports torch, transformers (to unpickle the model's config) and pagedserve's model code before it
can build its shard: seconds of CPU per rank, paid by every rank of every engine, and on a machine with few cores the
ranks' imports compete for them. With the 'forkserver' start method the imports happen once per engine process, in the
fork server (a fresh interpreter started at the first executor, that only imports: it runs no kernel, so it has no
OpenMP pool and no native library loaded, and holds no lock another thread could own), and each worker is a fork of
it. A worker then starts in well under a second after the first engine, and the first engine's ranks no longer
import side by side.

A fork holds the fork server's environment, which is the engine process's at the first executor: the worker takes
the engine process's environment at its own start instead (`run_in_environment`), as a spawned process would.
Where the platform has no fork server (Windows), workers are spawned.
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

# What every worker imports before it builds its shard (torch comes with them); the model config's module is added
# per engine (worker_context).
WORKER_PRELOAD_MODULES = ("pagedserve.executor.multiproc", "pagedserve.worker.worker")


def worker_context(config_module: str | None) -> Any:
    """The multiprocessing context that starts the workers: the fork server, preloading the worker's modules and
    `config_module` (the transformers module of the model's config class), or 'spawn' where there is none. The
    preload list only matters when the fork server starts (the first executor of the process); later engines' config
    modules are imported by their workers, cheaply once transformers is loaded."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*WORKER_PRELOAD_MODULES, *([config_module] if config_module else [])])
    return context


def run_in_environment(environment: dict[str, str], entry: Callable[..., None], *args: Any) -> None:
    """A worker's process target: take `environment` (the engine process's at the worker's start), then run
    `entry(*args)`."""
    os.environ.clear()
    os.environ.update(environment)
    entry(*args)
