"""batch_invariant=True: a request's logits are bitwise identical whatever else is in the batch.

Three sources of batch dependence on the CPU, and what removes each:
- GEMMs (matmul.py): MKL / oneDNN choose kernels and blocking from M, the number of rows; every row is
  computed in a GEMM of one fixed shape instead (fixed row tiles in one bmm).
- attention (attention.py): torch_paged pads decodes to their chunk's longest context and SDPA sizes its
  key blocks from the lengths; each token is attended alone in fixed key tiles, in a fixed order.
- reductions and transcendental elementwise ops (dispatch_mode.py, elementwise.py): single-value sums
  and means that ATen would split between threads, and functions whose scalar tail differs from the
  vector body (float32 silu / sigmoid).
All hold for a fixed intra-op thread count. The seam is step_mode.batch_invariant_step.
"""
from pagedserve.batch_invariant.step_mode import (
    SUPPORTED_ATTENTION_BACKENDS,
    batch_invariant_from_env,
    batch_invariant_step,
    check_batch_invariant_options,
)

__all__ = ["SUPPORTED_ATTENTION_BACKENDS", "batch_invariant_from_env", "batch_invariant_step",
           "check_batch_invariant_options"]
