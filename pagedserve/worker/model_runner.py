"""ModelRunner: turns a SchedulerOutput into one model forward and sampled tokens.

This file is shared by every model and feature: keep only common code here. Feature-specific work
(speculative decoding, graphs, connectors) plugs in through its own module.

Per step: apply the scheduler's deltas to the persistent InputBatch, build flat inputs (decodes first,
then prefills), run the model under a forward context carrying the attention metadata, compute logits
only at the positions that are sampled (plus prompt positions of requests that asked for prompt
logprobs), sample, and write the sampled tokens back into the persistent batch.

Async scheduling relies on that write-back: a decode step may be scheduled before the engine has seen
the token it consumes (a placeholder), and its input position is read from the persistent batch, where
the step before (run earlier on this worker, steps run in order) appended the token it sampled.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sample.logprobs import compute_prompt_logprobs
from pagedserve.sample.reduce_sample import sample_logits_function
from pagedserve.sample.sampler import Sampler
from pagedserve.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from pagedserve.worker.compiled_forward import build_model_forward
from pagedserve.worker.input_batch import InputBatch, RequestState, StepInputs
from pagedserve.worker.kv_cache_allocation import attention_layers
from pagedserve.worker.pipeline_stage_forward import build_stage_forward


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.input_batch = InputBatch(
            max_num_requests=config.scheduler_config.max_num_seqs,
            max_model_len=config.model_config.max_model_len,
            block_size=self.block_size,
        )
        self.sampler = Sampler()
        # Logits at the sampled positions: full logits, or reduce-sample candidates (sample/reduce_sample.py).
        self.sample_logits = sample_logits_function(model, config.parallel_config.enable_reduce_sample)
        # Seeded requests keep their generator across preemption, so a seed gives the same tokens
        # whatever happens to the batch; dropped only when the request finishes.
        self.generators: dict[str, torch.Generator] = {}
        # The model itself, or with pipeline parallelism this stage's receive / forward / send
        # (worker/pipeline_stage_forward.py); it returns None on a stage that does not sample.
        self.forward = build_stage_forward(model, config.model_config, device)
        if self.forward is model:
            # Graph capture (compilation_config / enforce_eager): the model itself when eager.
            self.forward = build_model_forward(model, config, device)
        if config.batch_invariant:
            # The whole step (forward, logits, sampler) under pagedserve/batch_invariant/'s dispatch mode.
            from pagedserve.batch_invariant import batch_invariant_step

            self.execute_model = batch_invariant_step(self.execute_model, model)  # type: ignore[method-assign]

    # ---- KV cache -------------------------------------------------------------------------------
    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        layers = attention_layers(self.model)
        assert len(layers) == len(kv_caches), (len(layers), len(kv_caches))
        for layer, cache in zip(layers, kv_caches):
            layer.kv_cache = cache

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_scheduler_output(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[])
        step = self._prepare_inputs(scheduler_output)
        metadata = self._build_attention_metadata(step)
        with set_forward_context(metadata):
            hidden_states = self.forward(step.input_ids, step.positions)
        if hidden_states is None:  # a pipeline stage before the last: the last stage samples
            return ModelRunnerOutput(request_ids=step.request_ids,
                                     sampled_token_ids=[[] for _ in step.request_ids])

        sampled_rows = np.nonzero(step.is_sampled)[0]
        sampled_token_ids: list[list[int]] = [[] for _ in step.request_ids]
        output = ModelRunnerOutput(request_ids=step.request_ids, sampled_token_ids=sampled_token_ids)
        if len(sampled_rows):
            logits_indices = torch.from_numpy(step.query_start_loc[1:][sampled_rows] - 1)
            states = [self.input_batch.requests[step.request_ids[i]] for i in sampled_rows]
            logits = self.sample_logits(hidden_states[logits_indices], [s.sampling_params for s in states])
            sampler_output = self.sampler(logits, self._sampling_metadata(states))
            token_ids = sampler_output.sampled_token_ids.tolist()
            logprobs_lists = None
            if sampler_output.logprobs is not None:
                logprobs_lists = sampler_output.logprobs.to_lists()
            for row_index, state, token_id in zip(sampled_rows, states, token_ids):
                sampled_token_ids[row_index] = [token_id]
                self.input_batch.append_token(state.row, token_id)
            if logprobs_lists is not None:
                for k, (row_index, state) in enumerate(zip(sampled_rows, states)):
                    num_logprobs = state.sampling_params.logprobs
                    if num_logprobs is not None:
                        output.logprobs[state.request_id] = logprobs_lists.slice(k, num_logprobs)
        self._compute_prompt_logprobs(step, hidden_states, output)
        return output

    def _apply_scheduler_output(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for request_id in scheduler_output.finished_request_ids:
            batch.remove_request(request_id)
            self.generators.pop(request_id, None)
        for request_id in scheduler_output.preempted_request_ids:
            batch.remove_request(request_id)
        for new in scheduler_output.scheduled_new_requests:
            batch.remove_request(new.request_id)  # a resumed request arrives whole again
            batch.add_request(new)
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self.generators:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
                self.generators[new.request_id] = generator
        cached = scheduler_output.scheduled_cached_requests
        for request_id, block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = batch.requests[request_id].row
            batch.append_blocks(row, block_ids)
            batch.num_computed_tokens[row] = num_computed
        if cached.new_token_ids:
            # Pipeline parallel: a stage that does not sample learns the sampled tokens here.
            for request_id, token_ids, num_computed in zip(
                    cached.request_ids, cached.new_token_ids, cached.num_computed_tokens):
                state = batch.requests[request_id]
                batch.extend_tokens(state.row, max(num_computed, state.num_prompt_tokens), token_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_scheduled_by_id = scheduler_output.num_scheduled_tokens
        # Decodes (one new token) first: backends batch them in one op.
        request_ids = sorted(num_scheduled_by_id, key=lambda rid: num_scheduled_by_id[rid] != 1)
        rows = np.fromiter((batch.requests[rid].row for rid in request_ids), dtype=np.int64,
                           count=len(request_ids))
        num_scheduled = np.fromiter((num_scheduled_by_id[rid] for rid in request_ids), dtype=np.int64,
                                    count=len(request_ids))
        query_start_loc = np.zeros(len(request_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        computed = batch.num_computed_tokens[rows]
        # positions[t] = computed[req(t)] + (t - query_start_loc[req(t)])
        token_rows = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = computed[token_rows] + (np.arange(num_tokens) - query_start_loc[token_rows])
        input_ids = batch.token_ids[rows[token_rows], positions]
        is_sampled = computed + num_scheduled == batch.num_tokens[rows]
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            positions_cpu=positions,
            request_ids=request_ids,
            rows=rows,
            num_scheduled=num_scheduled,
            query_start_loc=query_start_loc,
            num_computed_before=computed,
            is_sampled=is_sampled,
        )

    def _build_attention_metadata(self, step: StepInputs) -> AttentionMetadata:
        batch = self.input_batch
        block_size = self.block_size
        seq_lens = step.num_computed_before + step.num_scheduled
        max_num_blocks = int(-(-seq_lens.max() // block_size))
        block_table = batch.block_table[step.rows, :max_num_blocks]
        token_rows = np.repeat(np.arange(len(step.rows)), step.num_scheduled)
        positions = step.positions_cpu
        slot_mapping = block_table[token_rows, positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        num_decodes = int(np.count_nonzero(step.num_scheduled == 1))
        if num_decodes and not np.all(step.num_scheduled[:num_decodes] == 1):
            num_decodes = 0
        return AttentionMetadata(
            num_actual_tokens=int(step.query_start_loc[-1]),
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            query_start_loc=torch.from_numpy(step.query_start_loc.astype(np.int32)).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(self.device),
            max_query_len=int(step.num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_start_loc_cpu=step.query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=block_size,
        )

    def _sampling_metadata(self, states: list[RequestState]) -> SamplingMetadata:
        batch = self.input_batch
        params = [s.sampling_params for s in states]
        needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
        return build_sampling_metadata(
            params=params,
            prompt_token_ids=[batch.prompt_token_ids(s) if needs_prompt else [] for s in states],
            output_token_ids=[batch.output_token_ids(s) for s in states],
            generators=[self.generators.get(s.request_id) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _compute_prompt_logprobs(self, step: StepInputs, hidden_states: torch.Tensor,
                                 output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        for i, request_id in enumerate(step.request_ids):
            state = batch.requests[request_id]
            num_logprobs = state.sampling_params.prompt_logprobs
            if num_logprobs is None:
                continue
            start = int(step.num_computed_before[i])
            # Position p scores prompt token p + 1; the last prompt position scores the first output.
            end = min(start + int(step.num_scheduled[i]), state.num_prompt_tokens - 1)
            if end <= start:
                continue
            offset = int(step.query_start_loc[i])
            logits = self.model.compute_logits(hidden_states[offset:offset + end - start])
            targets = torch.from_numpy(batch.token_ids[state.row, start + 1:end + 1].copy()).to(self.device)
            output.prompt_logprobs[request_id] = compute_prompt_logprobs(
                logits, targets, num_logprobs).to_lists()
