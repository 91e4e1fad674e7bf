"""The xPyD arithmetic of `pagedserve bench pd`: from one instance's measured prefill and decode capacity and the
SLOs, the request rate a prefill (P) and a decode (D) instance each sustain, and the split of N instances that
serves the most (pure functions; the measurements are in pd_capacity.py).

The model, per instance:
- P serves prompts one after another: service time s = the mean prefill seconds of the workload's prompts. With
  Poisson arrivals at utilisation rho, an M/D/1 queue waits rho * s / (2 * (1 - rho)) on average, so the TTFT SLO T
  (less D's first step, which also lies inside the TTFT) holds on average while
  s + rho * s / (2 * (1 - rho)) <= T - first_step, i.e. rho <= 2d / (s + 2d) with d = T - first_step - s;
  a P sustains rho_max / s requests/s (none when d <= 0: one prompt alone misses the SLO).
- D decodes B requests at once at step time t(B) (measured at a few B, linear in between): the largest B with
  t(B) <= the TPOT SLO keeps every request's TPOT in bounds, and a D then finishes B / (t(B) * mean output tokens)
  requests/s.
- x P and y = N - x D serve min(x * P rate, y * D rate); the recommended split is the x that maximises it (ties:
  the fewer P). Colocated engines, for reference: one engine spends s + mean output * t(B) / B seconds of its time
  per request, an upper bound that ignores the TTFT queue and the prefill steps stalling the decode batch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillRate:
    """What one P sustains under the TTFT SLO."""

    service_seconds: float  # mean prefill seconds of one prompt
    slack_seconds: float  # d: the TTFT SLO less D's first step and the service time
    max_utilisation: float  # rho_max
    requests_per_second: float


@dataclass(frozen=True)
class DecodeRate:
    """What one D sustains under the TPOT SLO."""

    batch_size: int  # the largest batch whose step time meets the SLO (0: none does)
    step_seconds: float  # t(batch_size)
    requests_per_second: float


@dataclass(frozen=True)
class Split:
    num_prefill: int
    num_decode: int
    prefill_requests_per_second: float  # x * P rate
    decode_requests_per_second: float  # y * D rate

    @property
    def requests_per_second(self) -> float:
        return min(self.prefill_requests_per_second, self.decode_requests_per_second)

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D"


def prefill_rate(service_seconds: float, ttft_slo_seconds: float, first_step_seconds: float = 0.0) -> PrefillRate:
    """One P's sustainable request rate (M/D/1 mean wait within the TTFT SLO; see the module docstring)."""
    if service_seconds <= 0:
        raise ValueError(f"service_seconds={service_seconds} must be > 0")
    if ttft_slo_seconds <= 0:
        raise ValueError(f"ttft_slo_seconds={ttft_slo_seconds} must be > 0")
    slack = ttft_slo_seconds - first_step_seconds - service_seconds
    if slack <= 0:
        return PrefillRate(service_seconds, slack, 0.0, 0.0)
    utilisation = 2 * slack / (service_seconds + 2 * slack)
    return PrefillRate(service_seconds, slack, utilisation, utilisation / service_seconds)


def step_seconds_at(step_seconds: dict[int, float], batch_size: float) -> float:
    """t(B), linear between the measured batch sizes (and beyond the ends, along the nearest segment)."""
    sizes = sorted(step_seconds)
    if len(sizes) == 1:
        return step_seconds[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if batch_size <= high or high == sizes[-1]:
            slope = (step_seconds[high] - step_seconds[low]) / (high - low)
            return step_seconds[low] + slope * (batch_size - low)
    raise AssertionError("unreachable")


def decode_rate(step_seconds: dict[int, float], mean_output_tokens: float, tpot_slo_seconds: float,
                max_batch_size: int | None = None) -> DecodeRate:
    """One D's sustainable request rate: the largest batch (up to max_batch_size, else the largest measured) whose
    step time meets the TPOT SLO, over the tokens each request decodes."""
    if not step_seconds or any(size < 1 or seconds <= 0 for size, seconds in step_seconds.items()):
        raise ValueError(f"step_seconds={step_seconds} must map batch sizes >= 1 to seconds > 0")
    if mean_output_tokens <= 0:
        raise ValueError(f"mean_output_tokens={mean_output_tokens} must be > 0")
    limit = max_batch_size if max_batch_size is not None else max(step_seconds)
    best = 0
    for batch_size in range(1, limit + 1):
        if step_seconds_at(step_seconds, batch_size) <= tpot_slo_seconds:
            best = batch_size
    if best == 0:
        return DecodeRate(0, step_seconds_at(step_seconds, 1), 0.0)
    seconds = step_seconds_at(step_seconds, best)
    return DecodeRate(best, seconds, best / (seconds * mean_output_tokens))


def splits(prefill: PrefillRate, decode: DecodeRate, num_instances: int) -> list[Split]:
    """Every xPyD with x, y >= 1 and x + y = num_instances."""
    if num_instances < 2:
        raise ValueError(f"num_instances={num_instances} must be >= 2 (one P and one D at least)")
    return [Split(x, num_instances - x, x * prefill.requests_per_second,
                  (num_instances - x) * decode.requests_per_second) for x in range(1, num_instances)]


def recommend_split(prefill: PrefillRate, decode: DecodeRate, num_instances: int) -> Split:
    """The split that serves the most requests/s within the SLOs (ties: the fewer P)."""
    candidates = splits(prefill, decode, num_instances)
    return max(candidates, key=lambda split: (split.requests_per_second, -split.num_prefill))


def colocated_requests_per_second(prefill: PrefillRate, decode: DecodeRate, num_instances: int) -> float:
    """N colocated engines' rate if prefill and decode shared each engine's time without disturbing each other."""
    if decode.batch_size == 0:
        return 0.0
    seconds_per_request = prefill.service_seconds + 1.0 / decode.requests_per_second
    return num_instances / seconds_per_request


def explain(prefill: PrefillRate, decode: DecodeRate, num_instances: int, ttft_slo_seconds: float,
            tpot_slo_seconds: float, mean_output_tokens: float, first_step_seconds: float) -> str:
    """The arithmetic, line by line, ending with the recommendation."""
    lines = [f"P: s = {prefill.service_seconds * 1000:.1f} ms mean prefill; d = TTFT SLO {ttft_slo_seconds * 1000:.0f}"
             f" - first step {first_step_seconds * 1000:.1f} - s = {prefill.slack_seconds * 1000:.1f} ms"]
    if prefill.requests_per_second == 0:
        lines.append("   d <= 0: one prompt alone misses the TTFT SLO; no P sustains any rate")
    else:
        lines.append(f"   rho_max = 2d / (s + 2d) = {prefill.max_utilisation:.3f}; "
                     f"one P = rho_max / s = {prefill.requests_per_second:.2f} req/s")
    if decode.batch_size == 0:
        lines.append(f"D: even batch 1 steps in {decode.step_seconds * 1000:.1f} ms > TPOT SLO "
                     f"{tpot_slo_seconds * 1000:.0f} ms; no D sustains any rate")
    else:
        lines.append(f"D: largest batch with t(B) <= TPOT SLO {tpot_slo_seconds * 1000:.0f} ms: B = "
                     f"{decode.batch_size} (t = {decode.step_seconds * 1000:.1f} ms); one D = B / (t * "
                     f"{mean_output_tokens:.1f} output tokens) = {decode.requests_per_second:.2f} req/s")
    for split in splits(prefill, decode, num_instances):
        lines.append(f"   {split.name}: min({split.num_prefill} x {prefill.requests_per_second:.2f}, "
                     f"{split.num_decode} x {decode.requests_per_second:.2f}) = {split.requests_per_second:.2f} req/s")
    best = recommend_split(prefill, decode, num_instances)
    lines.append(f"   colocated x {num_instances} (no interference, an upper bound): {num_instances} / (s + 1 / D "
                 f"rate) = {colocated_requests_per_second(prefill, decode, num_instances):.2f} req/s")
    lines.append(f"recommended for {num_instances} instances: {best.name} ({best.requests_per_second:.2f} req/s "
                 f"within the SLOs)")
    return "\n".join(lines)
