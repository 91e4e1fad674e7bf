"""Fixtures for the engine-core tests: fabricated requests, schedulers and model-runner outputs."""
from __future__ import annotations

import itertools
from typing import Callable

import pytest

from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """`make_request(request_id, prompt_token_ids, **options)`: a Request with increasing arrival times.

    Options: max_tokens, min_tokens, stop_token_ids, ignore_eos, prompt_logprobs, logprobs,
    all_stop_token_ids (SamplingParams); eos_token_id, priority, cache_salt, arrival_time (Request).
    """
    arrival_clock = itertools.count()

    def factory(request_id: str, prompt_token_ids: list[int], *, eos_token_id: int | None = None,
                priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                all_stop_token_ids: set[int] | None = None, **sampling_options: object) -> Request:
        sampling_options.setdefault("max_tokens", 16)
        sampling_params = SamplingParams(**sampling_options)
        if all_stop_token_ids is not None:
            sampling_params.all_stop_token_ids = set(all_stop_token_ids)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_id=eos_token_id,
            arrival_time=float(next(arrival_clock)) if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )

    return factory


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    """`make_scheduler(num_blocks=..., block_size=..., enable_caching=..., **scheduler_config_fields)`."""

    def factory(*, num_blocks: int = 64, block_size: int = 4, enable_caching: bool = True,
                **config_fields: object) -> Scheduler:
        config_fields.setdefault("max_model_len", 64)
        config_fields.setdefault("max_num_batched_tokens", 64)
        config = SchedulerConfig(**config_fields)
        return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching), block_size)

    return factory


def fabricate_model_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    next_token: Callable[[str], int] = lambda request_id: 7,
) -> ModelRunnerOutput:
    """What a model runner would return: one sampled token for each request whose computed tokens
    caught up with its known tokens this step, nothing for a partial prefill chunk."""
    request_ids = list(scheduler_output.num_scheduled_tokens)
    sampled_token_ids = []
    for request_id in request_ids:
        request = scheduler.requests.get(request_id)
        is_caught_up = request is not None and request.num_computed_tokens == request.num_tokens
        sampled_token_ids.append([next_token(request_id)] if is_caught_up else [])
    return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=sampled_token_ids)


@pytest.fixture
def model_output() -> Callable[..., ModelRunnerOutput]:
    """`model_output(scheduler, scheduler_output, next_token=lambda request_id: 7)`."""
    return fabricate_model_output
