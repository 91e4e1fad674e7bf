"""Distributed state (tensor parallel groups) and the collectives layers use."""
from pagedserve.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    resolve_tensor_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "resolve_tensor_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
