"""LLM: the offline batch API, with vLLM's names and shapes."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from pagedserve.config.engine import EngineConfig
from pagedserve.engine.input_processor import apply_chat_template
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.engine.metrics_reader import Metric, scheduler_stats_to_metrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline generation: `LLM(model).generate(prompts, SamplingParams(...))`.

    `model` is an HF folder, a .gguf file, or None / 'smollm2-135m-instruct' for the embedded default.
    Keyword arguments are EngineConfig.create's (max_model_len, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, enable_prefix_caching, block_size, kv_cache_memory, num_kv_blocks, seed, ...).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 seed: int = 0, **kwargs: Any) -> None:
        config = EngineConfig.create(model, tokenizer=tokenizer, dtype=dtype, seed=seed, **kwargs)
        self.llm_engine = LLMEngine(config)

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries but there are "
                                 f"{len(prompts)} prompts; give one SamplingParams or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = engine.next_request_id()
                # final_only: one RequestOutput per request at the end, no per-step list copies.
                engine.add_request(request_id, prompt, params,
                                   priority=priority[index] if priority is not None else 0,
                                   output_kind="final_only")
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # a bad prompt rejects the whole call; nothing stays queued
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's turn."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = [
            {"prompt_token_ids": apply_chat_template(self.get_tokenizer(), conversation,
                                                     add_generation_prompt=add_generation_prompt,
                                                     chat_template=chat_template)}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, with vLLM's names (vLLM's LLM.get_metrics): running and
        waiting requests, KV-cache usage, prefix-cache queries and hits (local, and external: a KV connector's such as
        the KV pool, vllm:external_prefix_cache_queries / _hits), preemptions, and the speculative
        decoding counters (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, and the
        Vector vllm:spec_decode_num_accepted_tokens_per_pos)."""
        return scheduler_stats_to_metrics(self.llm_engine.engine_core.make_stats(),
                                          self.llm_engine.config.model_config.model)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block, so later prompts are computed afresh (as vLLM's LLM does); returns
        False, changing nothing, while requests are still unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while len(finished) < len(wanted):
                if not engine.has_unfinished_requests():
                    missing = sorted(wanted - set(finished))
                    raise RuntimeError(f"the engine went idle without finishing requests {missing}")
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            progress.close()
        return [finished[rid] for rid in request_ids]
