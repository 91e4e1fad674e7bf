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

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.decode_context_parallel import build_decode_context_parallel
from pagedserve.attention.forward_context import KVLayerSaver, set_forward_context
from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.prefill_context_parallel import build_prefill_context_parallel_forward
from pagedserve.models.native_decode_stack import NativeDecodeForward, build_native_decode_forward
from pagedserve.sample.fused_greedy_head import FusedGreedySampler, is_plain_greedy
from pagedserve.sample.logprobs import compute_prompt_logprobs
from pagedserve.sample.reduce_sample import sample_logits_function
from pagedserve.sample.sampler import Sampler
from pagedserve.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata, has_penalty
from pagedserve.structured_output.logits_mask import apply_grammar_bitmask, bitmask_of_rows
from pagedserve.worker.compiled_forward import build_model_forward
from pagedserve.worker.input_batch import InputBatch, RequestState, StepInputs, as_decode_rows
from pagedserve.worker.kv_cache_allocation import attention_layers
from pagedserve.worker.pipeline_stage_forward import build_stage_forward

if TYPE_CHECKING:  # imported only when speculation / sparse KV offload is on
    from pagedserve.sparse_kv_offload.offload_manager import SparseKVOffload
    from pagedserve.spec_decode.speculator import Speculator, VerifiedTokens


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 draft_model: nn.Module | None = None) -> None:
        """`draft_model`: speculative decoding's drafter (method 'draft_model'); its attention layers get KV
        caches beside the target's (kv_cache_modules)."""
        self.config = config
        self.model = model
        self.device = device
        # Positions per block id (the block table's unit); a page holds cache_config.block_size of them on this rank.
        self.block_size = config.tokens_per_block
        self.context_parallel = build_decode_context_parallel(config)
        self.vocab_size = config.model_config.vocab_size
        self.input_batch = InputBatch(
            max_num_requests=config.scheduler_config.max_num_seqs,
            max_model_len=config.model_config.max_model_len,
            block_size=self.block_size,
        )
        self.sampler = Sampler()
        # Logits at the sampled positions: full logits, or reduce-sample candidates (sample/reduce_sample.py).
        self.sample_logits = sample_logits_function(model, config.parallel_config.enable_reduce_sample)
        # All-greedy steps that need only the argmax take it inside the LM head where it can (no logits written).
        self.fused_greedy_sample = FusedGreedySampler(model, config.parallel_config.enable_reduce_sample)
        # Seeded requests keep their generator across preemption, so a seed gives the same tokens
        # whatever happens to the batch; dropped only when the request finishes.
        self.generators: dict[str, torch.Generator] = {}
        # (key, metadata) of the last step's sampling metadata while it may be reused (_sampling_metadata).
        self._cached_sampling_metadata: tuple[tuple[int, list[str]], SamplingMetadata] | None = None
        # The model itself, or with pipeline parallelism this stage's receive / forward / send
        # (worker/pipeline_stage_forward.py); it returns None on a stage that does not sample.
        self.forward = build_stage_forward(model, config.model_config, device)
        # EAGLE-3, DFlash and DSpark drafters read hidden states inside the target through hooks: it stays eager.
        if self.forward is model and not config.speculative_config.reads_target_layers:
            # Graph capture (compilation_config / enforce_eager): the model itself when eager.
            self.forward = build_model_forward(model, config, device)
            # Decode-only steps of qualifying models in one native call (models/native_decode_stack.py).
            self.forward = build_native_decode_forward(model, config, self.forward, device)
        # Prefill context parallel: this rank's run of the step's tokens through the model, the hidden states gathered
        # (distributed/prefill_context_parallel.py); the forward itself without it.
        self.forward = build_prefill_context_parallel_forward(config, self.forward)
        # Decode steps that only sample greedily: the native stack reads the batch, runs the model and the LM head's
        # argmax and appends the tokens, in one call (models/native_decode_stack.py).
        self.greedy_decode: Callable[[list[int], torch.Tensor | None], list[int] | None] | None = None
        if isinstance(self.forward, NativeDecodeForward) and self.fused_greedy_sample.is_enabled \
                and not config.speculative_config.reads_target_hidden_states:
            self.forward.bind_batch(self.input_batch)
            self.greedy_decode = self.forward.greedy_rows
        # Speculative decoding (spec_decode/): drafts in, verification, the next drafts out; None when off.
        self.speculator: Speculator | None = None
        if config.speculative_config.is_enabled:
            from pagedserve.spec_decode.speculator import Speculator

            self.speculator = Speculator(config.speculative_config, self.vocab_size,
                                         config.model_config.max_model_len,
                                         config.scheduler_config.max_num_batched_tokens, self.block_size, device,
                                         draft_model, self._build_attention_metadata, model,
                                         lambda module: build_native_decode_forward(module, config, module, device))
        # Verification steps run on the native decode stack, their tokens as decode rows (worker/input_batch.py
        # as_decode_rows), instead of the modules' multi-token path (benchmarks/README.md, speculative decoding).
        self.verifies_as_decode_rows = self.speculator is not None and isinstance(self.forward, NativeDecodeForward)
        self.max_verify_tokens = 1 + (config.speculative_config.num_speculative_tokens or 0)
        # Greedy verifications of such steps: the layers and the LM head's argmax of every token in one native call.
        self.greedy_targets: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
        if self.verifies_as_decode_rows and self.fused_greedy_sample.is_enabled \
                and not config.speculative_config.reads_target_hidden_states:
            self.greedy_targets = self.forward.greedy_targets
        # Sparse KV offload (sparse_kv_offload/): set by the worker when on; told each step's requests.
        self.kv_offload: SparseKVOffload | None = None
        # A layer-wise KV connector's save_kv_layer (the worker sets it; None: no connector saves per layer).
        self.kv_layer_saver: KVLayerSaver | None = None
        # Every module whose attention layers need KV caches, in binding order: the model, then the drafter.
        self.kv_cache_modules = nn.ModuleList([model] if draft_model is None else [model, draft_model])
        if config.batch_invariant:
            # The whole step (forward, logits, sampler) under pagedserve/batch_invariant/'s dispatch mode.
            from pagedserve.batch_invariant import batch_invariant_step

            self.execute_model = batch_invariant_step(self.execute_model, model)  # type: ignore[method-assign]

    # ---- KV cache -------------------------------------------------------------------------------
    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        layers = attention_layers(self.kv_cache_modules)
        assert len(layers) == len(kv_caches), (len(layers), len(kv_caches))
        for layer, cache in zip(layers, kv_caches):
            layer.kv_cache = cache

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_scheduler_output(scheduler_output)
        if self.kv_offload is not None:
            self.kv_offload.free_requests(scheduler_output.finished_request_ids
                                          | scheduler_output.preempted_request_ids)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[])
        if self.speculator is None:
            return self._execute(scheduler_output)
        self.speculator.write_drafts(self.input_batch, scheduler_output.scheduled_spec_decode_tokens)
        output = self._execute(scheduler_output)
        output.spec_token_ids = self.speculator.propose(self.input_batch, output.request_ids,
                                                        output.sampled_token_ids, self.generators,
                                                        scheduler_output.scheduled_spec_decode_tokens)
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        grammar_bitmask = scheduler_output.grammar_bitmask
        if self.greedy_decode is not None:
            output = self._greedy_decode_step(scheduler_output)
            if output is not None:
                return output
        step = self._prepare_inputs(scheduler_output)
        attention_step = step
        verifies_on_stack = False
        if self.verifies_as_decode_rows and scheduler_output.scheduled_spec_decode_tokens \
                and int(step.num_scheduled.max()) <= self.max_verify_tokens:
            # A verification step (no prefill chunk): the native decode stack takes its tokens as decode rows, and
            # with the LM head's argmax of every row when that is all the verification reads.
            attention_step = as_decode_rows(step)
            assert self.speculator is not None
            verifies_on_stack = self.greedy_targets is not None and grammar_bitmask is None \
                and not self.input_batch.num_prompt_logprobs_requests \
                and self.speculator.can_verify_from_targets(step, self.input_batch)
        metadata = self._build_attention_metadata(attention_step)
        if self.kv_offload is not None:
            self.kv_offload.begin_step(attention_step.request_ids, attention_step.num_scheduled)
        with set_forward_context(metadata, self.kv_layer_saver):
            if verifies_on_stack and (output := self._verify_on_stack(scheduler_output, step)) is not None:
                return output
            hidden_states = self.forward(step.input_ids, step.positions)
        if hidden_states is None:  # a pipeline stage before the last: the last stage samples
            return ModelRunnerOutput(request_ids=step.request_ids,
                                     sampled_token_ids=[[] for _ in step.request_ids])
        if self.speculator is not None:
            self.speculator.observe_forward(step, hidden_states)
        if scheduler_output.scheduled_spec_decode_tokens:
            return self._verify_drafts(scheduler_output, step, hidden_states)
        num_requests = len(step.request_ids)
        sampled_rows = step.is_sampled.nonzero()[0]  # 1-D: flatnonzero's ravel costs ~25 us more, cold
        num_sampled = len(sampled_rows)
        sampled_token_ids: list[list[int]] = [[] for _ in step.request_ids]
        output = ModelRunnerOutput(request_ids=step.request_ids, sampled_token_ids=sampled_token_ids)
        if num_sampled:
            requests = self.input_batch.requests
            if num_sampled == num_requests and step.token_requests is None:
                # Every request computes one token and samples from it: the sampled positions are
                # rows 0..n-1 of the hidden states, so no gather is needed (same values, same GEMM).
                states = [requests[request_id] for request_id in step.request_ids]
                sampled_states = hidden_states if hidden_states.shape[0] == num_sampled \
                    else hidden_states[:num_sampled]
            else:
                logits_indices = torch.from_numpy(step.query_start_loc[1:][sampled_rows] - 1)
                states = [requests[step.request_ids[i]] for i in sampled_rows]
                sampled_states = hidden_states[logits_indices]
            metadata = self._sampling_metadata(states)
            allowed = None if grammar_bitmask is None \
                else bitmask_of_rows(grammar_bitmask, [s.request_id for s in states])[0]
            sampler_output = self.fused_greedy_sample(sampled_states, metadata, allowed)
            if sampler_output is None:
                logits = self.sample_logits(sampled_states, [s.sampling_params for s in states])
                if grammar_bitmask is not None:  # structured outputs (structured_output/logits_mask.py)
                    apply_grammar_bitmask(logits, grammar_bitmask, [s.request_id for s in states])
                sampler_output = self.sampler(logits, metadata)
            token_ids = sampler_output.sampled_token_ids.tolist()
            logprobs_lists = None
            if sampler_output.logprobs is not None:
                logprobs_lists = sampler_output.logprobs.to_lists()
            self.input_batch.append_tokens(step.rows[sampled_rows], np.array(token_ids, dtype=np.int64))
            for row_index, token_id in zip(sampled_rows.tolist(), token_ids):
                sampled_token_ids[row_index] = [token_id]
            if logprobs_lists is not None:
                for k, state in enumerate(states):
                    num_logprobs = state.sampling_params.logprobs
                    if num_logprobs is not None:
                        output.logprobs[state.request_id] = logprobs_lists.slice(k, num_logprobs)
        if self.input_batch.num_prompt_logprobs_requests:
            self._compute_prompt_logprobs(step, hidden_states, output)
        return output

    def _verify_drafts(self, scheduler_output: SchedulerOutput, step: StepInputs,
                       hidden_states: torch.Tensor) -> ModelRunnerOutput:
        """A step with drafts: the speculator scores and verifies them and appends what it emits."""
        assert self.speculator is not None
        verified = self.speculator.verify(step, hidden_states, self.input_batch,
                                          scheduler_output.scheduled_spec_decode_tokens, self.generators,
                                          self.model.compute_logits, scheduler_output.grammar_bitmask)
        output = self._verified_output(step, verified)
        if self.input_batch.num_prompt_logprobs_requests:
            self._compute_prompt_logprobs(step, hidden_states, output)
        return output

    def _verify_on_stack(self, scheduler_output: SchedulerOutput, step: StepInputs) -> ModelRunnerOutput | None:
        """A greedy verification as one native call: the layers and the LM head's argmax of every token on the decode
        stack, then the speculator's greedy rule. None, with nothing run, when the stack does not take the step."""
        assert self.greedy_targets is not None and self.speculator is not None
        target_ids = self.greedy_targets(step.input_ids, step.positions)
        if target_ids is None:
            return None
        return self._verified_output(step, self.speculator.verify_targets(
            step, target_ids, self.input_batch, scheduler_output.scheduled_spec_decode_tokens))

    @staticmethod
    def _verified_output(step: StepInputs, verified: VerifiedTokens) -> ModelRunnerOutput:
        sampled_token_ids: list[list[int]] = [[] for _ in step.request_ids]
        for index, token_ids in zip(verified.request_indices, verified.token_ids):
            sampled_token_ids[index] = token_ids
        return ModelRunnerOutput(request_ids=step.request_ids, sampled_token_ids=sampled_token_ids,
                                 logprobs=verified.logprobs)

    def _greedy_decode_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """A step in which every request decodes one token and samples it greedily with nothing else asked (no
        logprobs, penalties or min_tokens), run by greedy_decode from the persistent batch: inputs, forward, the LM
        head's argmax and the append in one call. None, with nothing changed, when that does not apply."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        if scheduler_output.total_num_scheduled_tokens != len(num_scheduled) \
                or self.input_batch.num_prompt_logprobs_requests:
            return None
        requests = self.input_batch.requests
        states = [requests[request_id] for request_id in num_scheduled]
        if not is_plain_greedy(self._sampling_metadata(states)):
            return None
        grammar_bitmask = scheduler_output.grammar_bitmask  # structured outputs: the head picks allowed tokens only
        allowed = None if grammar_bitmask is None else bitmask_of_rows(grammar_bitmask, list(num_scheduled))[0]
        token_ids = self.greedy_decode([state.row for state in states], allowed)
        if token_ids is None:
            return None
        return ModelRunnerOutput(request_ids=list(num_scheduled),
                                 sampled_token_ids=[[token_id] for token_id in token_ids])

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

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """`array` as a tensor on the runner's device: on the CPU the array's own memory. A step makes a handful;
        Tensor.to, even to the device a tensor is already on, cost ~20 us each of a batch-1 decode step (cold
        caches after the step's weight stream, Zen 4 VM)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_scheduled_by_id = scheduler_output.num_scheduled_tokens
        num_requests = len(num_scheduled_by_id)
        request_ids = list(num_scheduled_by_id)
        num_scheduled = np.fromiter(num_scheduled_by_id.values(), dtype=np.int64, count=num_requests)
        is_multi_token = num_scheduled != 1
        num_decodes = num_requests - int(np.count_nonzero(is_multi_token))
        if is_multi_token[:num_decodes].any():
            # Decodes (one new token) first, each group in scheduling order: backends batch them in one op.
            order = np.argsort(is_multi_token, kind="stable")
            request_ids = [request_ids[i] for i in order.tolist()]
            num_scheduled = num_scheduled[order]
        requests = batch.requests
        rows = np.fromiter((requests[rid].row for rid in request_ids), dtype=np.int64, count=num_requests)
        computed = batch.num_computed_tokens[rows]
        if num_decodes == num_requests:
            # One token per request: token t is request t's, at position computed[t].
            token_requests = None
            query_start_loc = np.arange(num_requests + 1, dtype=np.int64)
            positions = computed.copy()  # a tensor shares this buffer; num_computed_before keeps its own
            input_ids = batch.token_ids[rows, positions]
        else:
            query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            num_tokens = int(query_start_loc[-1])
            # positions[t] = computed[req(t)] + (t - query_start_loc[req(t)])
            token_requests = np.repeat(np.arange(num_requests), num_scheduled)
            positions = computed[token_requests] + (np.arange(num_tokens) - query_start_loc[token_requests])
            input_ids = batch.token_ids[rows[token_requests], positions]
        # Steps that reach the last known token sample (drafts, when scheduled, lie past it).
        is_sampled = computed + num_scheduled >= batch.num_tokens[rows]
        return StepInputs(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            positions_cpu=positions,
            request_ids=request_ids,
            rows=rows,
            token_requests=token_requests,
            num_scheduled=num_scheduled,
            query_start_loc=query_start_loc,
            num_computed_before=computed,
            is_sampled=is_sampled,
        )

    def _build_attention_metadata(self, step: StepInputs) -> AttentionMetadata:
        batch = self.input_batch
        block_size = self.block_size
        seq_lens = step.num_computed_before + step.num_scheduled
        max_seq_len = int(seq_lens.max())
        max_num_blocks = -(-max_seq_len // block_size)
        block_table = batch.block_table[step.rows, :max_num_blocks]  # a fresh, contiguous copy
        positions = step.positions_cpu
        token_requests = step.token_requests
        if token_requests is None:
            token_requests = np.arange(len(step.rows))
            num_decodes = len(step.rows)
        else:
            num_decodes = int(np.count_nonzero(step.num_scheduled == 1))
            if num_decodes and not np.all(step.num_scheduled[:num_decodes] == 1):
                num_decodes = 0
        block_ids = block_table[token_requests, positions // block_size]
        context_parallel = None
        if self.context_parallel is None:
            slot_mapping = block_ids.astype(np.int64) * block_size + positions % block_size
        else:
            slot_mapping, context_parallel = self.context_parallel.local_slots(block_ids, positions, self.device)
        num_tokens = len(positions)
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=self._tensor(slot_mapping),
            query_start_loc=self._tensor(step.query_start_loc.astype(np.int32)),
            seq_lens=self._tensor(seq_lens.astype(np.int32)),
            block_table=self._tensor(np.ascontiguousarray(block_table)),
            max_query_len=1 if step.token_requests is None else int(step.num_scheduled.max()),
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_start_loc_cpu=step.query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=self.config.cache_config.block_size,
            context_parallel=context_parallel,
        )

    def _sampling_metadata(self, states: list[RequestState]) -> SamplingMetadata:
        """The batched sampling settings of the sampled rows `states`.

        Reused from the step before when the same requests sample in the same order, the batch has not
        changed since (InputBatch.version), and nothing in it depends on the step: no penalties (they
        read the tokens so far) and no min_tokens masking (it stops once enough tokens are out; a row
        that masks nothing now never will, since its output only grows).
        """
        batch = self.input_batch
        key = (batch.version, [s.request_id for s in states])
        cached = self._cached_sampling_metadata
        if cached is not None and cached[0] == key:
            return cached[1]
        params = [s.sampling_params for s in states]
        needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
        metadata = build_sampling_metadata(
            params=params,
            prompt_token_ids=[batch.prompt_token_ids(s) if needs_prompt else [] for s in states],
            # Only penalties and min_tokens read the outputs; other rows pass none (the same result).
            output_token_ids=[batch.output_token_ids(s) if p.min_tokens or has_penalty(p) else []
                              for s, p in zip(states, params)],
            generators=[self.generators.get(s.request_id) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        is_step_independent = metadata.no_penalties and metadata.min_tokens_row_ids is None
        self._cached_sampling_metadata = (key, metadata) if is_step_independent else None
        return metadata

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
            targets = self._tensor(batch.token_ids[state.row, start + 1:end + 1].copy())
            output.prompt_logprobs[request_id] = compute_prompt_logprobs(
                logits, targets, num_logprobs).to_lists()
