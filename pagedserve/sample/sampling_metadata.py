"""SamplingMetadata: the per-step, batched view of every sampled row's SamplingParams.

The model runner builds one each step with build_sampling_metadata(); the Sampler reads it. All the
host-side decisions (fast-path flags, the largest top-k, which rows need min_tokens masking) are made
here, so the Sampler itself never has to synchronise with the device to decide what to do.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagedserve.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingMetadata:
    """Batched sampling settings, one row per request sampled this step (same order as the logits).

    Tensors are None when the batch does not use the feature; the matching no_* / all_* flag is then
    True. Per-row tensors hold neutral values for rows that do not use a feature the batch uses.
    """

    num_rows: int
    vocab_size: int
    device: torch.device

    all_greedy: bool
    all_random: bool
    # [num_rows] float32. Greedy rows hold 1.0 so the division is safe; their result is replaced by
    # the argmax anyway. None when all_greedy.
    temperature: torch.Tensor | None
    # [num_rows] bool, True for greedy rows. Only set for mixed batches (neither all_greedy nor all_random).
    is_greedy: torch.Tensor | None

    no_top_k: bool
    # [num_rows] int64; rows without top-k hold vocab_size. None when no_top_k.
    top_k: torch.Tensor | None
    # Largest enabled top-k (host int, so the Sampler can size torch.topk without a sync); 0 when no_top_k.
    max_top_k: int
    # True when every row has top-k enabled (then top-p only needs the best max_top_k candidates).
    all_top_k: bool
    no_top_p: bool
    # [num_rows] float32; rows without top-p hold 1.0. None when no_top_p.
    top_p: torch.Tensor | None
    no_min_p: bool
    # [num_rows] float32; rows without min-p hold 0.0. None when no_min_p.
    min_p: torch.Tensor | None

    # Row index -> that request's generator, for seeded random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    # Largest number of top logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None = None

    no_penalties: bool = True
    # [num_rows] float32 each; neutral values (0, 0, 1) for rows without penalties. None when no_penalties.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [num_rows, max_len] int64, right-padded with vocab_size (an id that matches no logit). Only rows
    # with a penalty carry their tokens; the others are all padding. None when no_penalties.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None

    # min_tokens: (row, token) pairs to set to -inf: EOS and stop ids of rows still below min_tokens.
    # Both [num_pairs] int64, or both None when no row needs masking.
    min_tokens_row_ids: torch.Tensor | None = None
    min_tokens_token_ids: torch.Tensor | None = None


def has_penalty(params: SamplingParams) -> bool:
    """Whether `params` sets a presence, frequency or repetition penalty."""
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def _padded_token_ids(
    rows: list[list[int]], vocab_size: int, device: torch.device, field_name: str
) -> torch.Tensor:
    """Right-pad token id lists to one [num_rows, max_len] int64 tensor, padding with vocab_size."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    max_length = int(lengths.max()) if rows else 0
    padded = torch.full((len(rows), max_length), vocab_size, dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    if flat.numel() > 0:
        lowest, highest = int(flat.min()), int(flat.max())
        if lowest < 0 or highest >= vocab_size:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"{field_name} contains token id {bad}, outside [0, {vocab_size - 1}] (vocab_size)")
        # Boolean-mask assignment fills row-major, the same order as the chained lists.
        is_real = torch.arange(max_length).unsqueeze(0) < lengths.unsqueeze(1)
        padded[is_real] = flat
    return padded.to(device)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Batch the sampling settings of the rows sampled this step.

    params[i], prompt_token_ids[i], output_token_ids[i] and generators[i] describe logits row i.
    output_token_ids[i] are the tokens the request has generated so far (they drive min_tokens and
    the frequency/presence penalties). generators[i] must be set for every seeded random row (it is
    advanced in place each step, which is what makes a seeded request reproducible) and on `device`.
    Raises ValueError on inconsistent inputs.
    """
    num_rows = len(params)
    device = torch.device(device)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} must be an integer >= 1")
    for name, values in (
        ("prompt_token_ids", prompt_token_ids),
        ("output_token_ids", output_token_ids),
        ("generators", generators),
    ):
        if len(values) != num_rows:
            raise ValueError(f"len({name})={len(values)} must equal len(params)={num_rows}")
    for row, row_params in enumerate(params):
        if not isinstance(row_params, SamplingParams):
            raise ValueError(f"params[{row}]={row_params!r} must be a SamplingParams")

    sampling_types = [p.sampling_type for p in params]
    num_greedy = sum(t == SamplingType.GREEDY for t in sampling_types)
    all_greedy = num_greedy == num_rows
    all_random = num_greedy == 0

    row_generators: dict[int, torch.Generator] = {}
    for row, (sampling_type, generator) in enumerate(zip(sampling_types, generators)):
        if sampling_type == SamplingType.RANDOM_SEED and generator is None:
            raise ValueError(f"generators[{row}]=None but params[{row}].seed={params[row].seed}: "
                             "a seeded random row needs its own torch.Generator")
        if sampling_type != SamplingType.GREEDY and generator is not None:
            if generator.device.type != device.type:
                raise ValueError(f"generators[{row}] is on {generator.device}, must be on {device.type}")
            row_generators[row] = generator

    def float_column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperature = None
    is_greedy = None
    if not all_greedy:
        temperature = float_column([1.0 if t == SamplingType.GREEDY else p.temperature
                                    for t, p in zip(sampling_types, params)])
        if not all_random:
            is_greedy = torch.tensor([t == SamplingType.GREEDY for t in sampling_types],
                                     dtype=torch.bool, device=device)

    # A top-k at or above the vocabulary keeps everything: treat it as disabled.
    top_k_values = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    enabled_top_k = [k for k in top_k_values if k < vocab_size]
    no_top_k = not enabled_top_k
    no_top_p = all(p.top_p >= 1.0 for p in params)
    no_min_p = all(p.min_p <= 0.0 for p in params)

    wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    max_num_logprobs = max(wanted_logprobs) if wanted_logprobs else None
    if max_num_logprobs is not None and max_num_logprobs > vocab_size:
        raise ValueError(f"logprobs={max_num_logprobs} must be <= vocab_size={vocab_size}")

    metadata = SamplingMetadata(
        num_rows=num_rows,
        vocab_size=vocab_size,
        device=device,
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=temperature,
        is_greedy=is_greedy,
        no_top_k=no_top_k,
        top_k=None if no_top_k else torch.tensor(top_k_values, dtype=torch.int64, device=device),
        max_top_k=max(enabled_top_k) if enabled_top_k else 0,
        all_top_k=len(enabled_top_k) == num_rows and num_rows > 0,
        no_top_p=no_top_p,
        top_p=None if no_top_p else float_column([p.top_p for p in params]),
        no_min_p=no_min_p,
        min_p=None if no_min_p else float_column([p.min_p for p in params]),
        generators=row_generators,
        max_num_logprobs=max_num_logprobs,
    )

    is_penalised = [has_penalty(p) for p in params]
    if any(is_penalised):
        metadata.no_penalties = False
        metadata.presence_penalties = float_column([p.presence_penalty for p in params])
        metadata.frequency_penalties = float_column([p.frequency_penalty for p in params])
        metadata.repetition_penalties = float_column([p.repetition_penalty for p in params])
        # Only penalised rows need their history on the device; the rest stay pure padding.
        metadata.prompt_token_ids = _padded_token_ids(
            [list(ids) if penalised else [] for ids, penalised in zip(prompt_token_ids, is_penalised)],
            vocab_size, device, "prompt_token_ids")
        metadata.output_token_ids = _padded_token_ids(
            [list(ids) if penalised else [] for ids, penalised in zip(output_token_ids, is_penalised)],
            vocab_size, device, "output_token_ids")

    # min_tokens: until a request has min_tokens outputs it may not stop, so its EOS ids (the engine
    # puts them in all_stop_token_ids) and its stop_token_ids must not be sampled.
    mask_row_ids: list[int] = []
    mask_token_ids: list[int] = []
    for row, (row_params, outputs) in enumerate(zip(params, output_token_ids)):
        if len(outputs) >= row_params.min_tokens:
            continue
        # Ids beyond the logits can never be sampled, so there is nothing to mask for them.
        stop_ids = sorted(t for t in set(row_params.all_stop_token_ids) | set(row_params.stop_token_ids)
                          if t < vocab_size)
        mask_row_ids.extend([row] * len(stop_ids))
        mask_token_ids.extend(stop_ids)
    if mask_row_ids:
        metadata.min_tokens_row_ids = torch.tensor(mask_row_ids, dtype=torch.int64, device=device)
        metadata.min_tokens_token_ids = torch.tensor(mask_token_ids, dtype=torch.int64, device=device)
    return metadata
