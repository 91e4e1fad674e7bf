"""Joining a worker process to its engine's torch.distributed world and carving the groups."""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed

from pagedserve.config.parallel import ParallelConfig
from pagedserve.distributed.parallel_state import ParallelSizes, initialize_model_parallel
from pagedserve.platforms import Platform

# A peer that died leaves the others blocked in a collective; the executor notices the death within
# milliseconds and kills the survivors, so this is only the last resort.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def initialize_worker_distributed(parallel_config: ParallelConfig, rank: int, init_method: str | None,
                                  platform: Platform) -> None:
    """init_process_group over `init_method` (tcp://127.0.0.1:PORT) with the platform's backend, then
    carve the TP / PP / PCP / fine-grained groups of one engine (DP ranks are separate engine cores)."""
    world_size = parallel_config.world_size_per_engine
    if init_method is None:
        raise ValueError(f"rank {rank} of a world of {world_size} needs a distributed_init_method")
    if platform.device_type == "cuda":
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=platform.dist_backend, init_method=init_method,
                                             rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    initialize_model_parallel(ParallelSizes(
        tensor_parallel_size=parallel_config.tensor_parallel_size,
        pipeline_parallel_size=parallel_config.pipeline_parallel_size,
        data_parallel_size=1,
        lmhead_tensor_parallel_size=parallel_config.lmhead_tensor_parallel_size,
        embedding_tensor_parallel_size=parallel_config.embedding_tensor_parallel_size,
        oproj_tensor_parallel_size=parallel_config.oproj_tensor_parallel_size,
        decode_context_parallel_size=parallel_config.decode_context_parallel_size,
        prefill_context_parallel_size=parallel_config.prefill_context_parallel_size,
    ))


def agree_on_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the world (every rank must call it)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())
