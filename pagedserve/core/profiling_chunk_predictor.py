"""Profiling-tuned chunked prefill: a fitted step-latency model picks each prefill chunk's size.

At start the worker times forward passes of several chunk lengths (`LatencySample`s). This module fits

    seconds = a + b * n + c * n^2 + d * n * h

by least squares, where n is the number of tokens in the step and h the history (already computed
tokens) the prefill chunk attends to; `d` is fitted only when some sample has history. Each step the
`ProfilingChunkPolicy` picks the largest chunk n such that a step of n + (other tokens) is predicted to
fit the step budget: the target TPOT of the running decodes (each decode gets one token per step), or,
without a target, the predicted time of a full `max_num_batched_tokens` step without history (chunks
then shrink as history grows so that every chunk costs the same). The choice is smoothed across steps
(EMA), aligned down to the block size, and never below a floor (so a prompt always makes progress).

Pure Python (no torch, no numpy): core/ is tested with fabricated timings.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.prefill_chunk_policy import PrefillChunkPolicy


@dataclass(frozen=True)
class LatencySample:
    num_tokens: int  # tokens computed in the step
    num_history_tokens: int  # tokens already in the KV cache that the chunk attends to
    seconds: float


@dataclass(frozen=True)
class LatencyModel:
    """seconds = intercept + linear * n + quadratic * n^2 + history * n * h."""

    intercept: float
    linear: float
    quadratic: float
    history: float = 0.0

    def predict(self, num_tokens: int, num_history_tokens: int = 0) -> float:
        n = float(num_tokens)
        return self.intercept + self.linear * n + self.quadratic * n * n + self.history * n * num_history_tokens


def _solve_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least-squares solution of rows @ x = targets via normal equations on column-scaled features.

    Columns are scaled to unit max magnitude first (n^2 and n*h are ~1e7 times larger than 1), so the
    Gaussian elimination with partial pivoting stays well conditioned. Raises ValueError if singular.
    """
    num_columns = len(rows[0])
    scales = [max(abs(row[j]) for row in rows) or 1.0 for j in range(num_columns)]
    scaled = [[row[j] / scales[j] for j in range(num_columns)] for row in rows]
    normal = [[sum(r[i] * r[j] for r in scaled) for j in range(num_columns)] +
              [sum(r[i] * t for r, t in zip(scaled, targets))] for i in range(num_columns)]
    for column in range(num_columns):
        pivot = max(range(column, num_columns), key=lambda row: abs(normal[row][column]))
        if abs(normal[pivot][column]) < 1e-12:
            raise ValueError("latency samples do not determine the model (too few distinct token counts)")
        normal[column], normal[pivot] = normal[pivot], normal[column]
        for row in range(num_columns):
            if row != column:
                factor = normal[row][column] / normal[column][column]
                normal[row] = [value - factor * pivot_value for value, pivot_value in zip(normal[row], normal[column])]
    return [normal[j][num_columns] / normal[j][j] / scales[j] for j in range(num_columns)]


def fit_latency_model(samples: list[LatencySample]) -> LatencyModel:
    """Least-squares fit of a + b n + c n^2 (+ d n h when some sample has history), every coefficient >= 0.

    Needs >= 3 distinct token counts (>= 4 samples with some history for the history term). A negative
    coefficient is noise (a concave, almost linear curve; a negative intercept from slow small chunks): it is
    dropped (held at 0) and the rest refitted, the quadratic and history terms first, then the intercept, then
    the slope. So predictions are never negative and never decrease as chunks or histories grow, which the
    chunk search relies on. Raises ValueError on unusable samples.
    """
    for sample in samples:
        if sample.num_tokens < 1 or sample.num_history_tokens < 0 or not sample.seconds >= 0:
            raise ValueError(f"latency sample {sample!r}: num_tokens must be >= 1, num_history_tokens >= 0 "
                             f"and seconds >= 0")
    if len({sample.num_tokens for sample in samples}) < 3:
        raise ValueError(f"latency samples: {len(samples)} sample(s) with "
                         f"{len({s.num_tokens for s in samples})} distinct token count(s); at least 3 are needed")
    features = {
        "intercept": lambda s: 1.0,
        "linear": lambda s: float(s.num_tokens),
        "quadratic": lambda s: float(s.num_tokens) ** 2,
        "history": lambda s: float(s.num_tokens * s.num_history_tokens),
    }
    active = [name for name in features
              if name != "history" or any(sample.num_history_tokens for sample in samples)]
    while True:
        rows = [[features[name](sample) for name in active] for sample in samples]
        coefficients = dict(zip(active, _solve_least_squares(rows, [s.seconds for s in samples])))
        negative = [name for name in ("quadratic", "history", "intercept", "linear") if coefficients.get(name, 0) < 0]
        if not negative:
            return LatencyModel(**{name: coefficients.get(name, 0.0) for name in features})
        active.remove(negative[0])


class ProfilingChunkPolicy(PrefillChunkPolicy):
    """Largest chunk whose predicted step time fits the budget; EMA-smoothed, block-aligned, floored.

    `step_budget_seconds`: the time one step may take (the target TPOT). `max_chunk`: the largest chunk
    ever returned (the token budget). `smoothing` in (0, 1]: weight of the new choice in the EMA
    (1: no smoothing). `min_chunk`: the floor, aligned down to the block size but at least one block.
    """

    def __init__(self, model: LatencyModel, step_budget_seconds: float, block_size: int, max_chunk: int,
                 min_chunk: int, smoothing: float = 1.0) -> None:
        if not step_budget_seconds > 0:
            raise ValueError(f"step_budget_seconds={step_budget_seconds!r} must be > 0")
        if block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be >= 1")
        if max_chunk < 1:
            raise ValueError(f"max_chunk={max_chunk!r} must be >= 1")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing={smoothing!r} must be in (0, 1]")
        self.model = model
        self.step_budget_seconds = step_budget_seconds
        self.block_size = block_size
        self.max_chunk = max_chunk
        self.min_chunk = min(max_chunk, max(block_size, min_chunk // block_size * block_size))
        self.smoothing = smoothing
        self._smoothed: float | None = None

    def largest_fitting_chunk(self, num_other_tokens: int, num_history_tokens: int) -> int:
        """Largest n in [0, max_chunk] with predict(other + n, history) <= budget (0 if none fits).

        Binary search: the fit's coefficients are all >= 0 (fit_latency_model), so predictions are
        non-decreasing in n.
        """
        def fits(n: int) -> bool:
            return self.model.predict(num_other_tokens + n, num_history_tokens) <= self.step_budget_seconds

        if not fits(1):
            return 0
        low, high = 1, self.max_chunk  # fits(low) holds
        if fits(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def prefill_token_cap(self, num_other_tokens: int, num_history_tokens: int) -> int:
        raw = self.largest_fitting_chunk(num_other_tokens, num_history_tokens)
        if self._smoothed is None:
            self._smoothed = float(raw)
        else:
            self._smoothed = self.smoothing * raw + (1 - self.smoothing) * self._smoothed
        aligned = int(self._smoothed) // self.block_size * self.block_size
        return max(self.min_chunk, min(aligned, self.max_chunk))


def build_profiling_chunk_policy(samples: list[LatencySample], target_tpot_ms: float | None, block_size: int,
                                 max_num_batched_tokens: int, min_chunk: int,
                                 smoothing: float) -> ProfilingChunkPolicy:
    """Fit the samples and build the policy; the budget is the target TPOT or, without one, the
    predicted time of a full `max_num_batched_tokens` chunk with no history."""
    model = fit_latency_model(samples)
    if target_tpot_ms is not None:
        budget = target_tpot_ms / 1000.0
    else:
        budget = model.predict(max_num_batched_tokens, 0)
    return ProfilingChunkPolicy(model, step_budget_seconds=budget, block_size=block_size,
                                max_chunk=max_num_batched_tokens, min_chunk=min_chunk, smoothing=smoothing)


__all__ = ["LatencyModel", "LatencySample", "ProfilingChunkPolicy", "build_profiling_chunk_policy",
           "fit_latency_model"]
