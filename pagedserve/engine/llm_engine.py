"""LLMEngine: the synchronous front end over an in-process EngineCore.

Requests go in as prompts (text or token ids) with SamplingParams; `step()` advances every request
one engine step and returns the RequestOutputs that changed. LLM (offline batch) and the chat command
(streaming) both drive it.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

from pagedserve.config.engine import EngineConfig
from pagedserve.core.request import RequestStatus
from pagedserve.engine.dp_engine_core import create_engine_core
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.kv_transfer.kv_transfer_params import check_kv_transfer_params_accepted
from pagedserve.model_loader.model_source import open_model_source
from pagedserve.outputs import RequestOutput
from pagedserve.sample.reduce_sample import check_reduce_sample_params
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.grammar_validation import structured_outputs_refusal

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = open_model_source(config.model_config.model)
        self.tokenizer = source.load_tokenizer(config.model_config.tokenizer)
        self.engine_core = create_engine_core(config)
        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer,
            vocab_size=config.model_config.vocab_size,
            max_model_len=config.model_config.max_model_len,
            eos_token_ids=source.eos_token_ids(self.tokenizer),
            structured_outputs_refusal=structured_outputs_refusal(self.config),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.create(model, **kwargs))

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, output_kind: str = "cumulative") -> None:
        """Validate and enqueue one prompt (n > 1 fans out into n engine requests)."""
        if self.config.parallel_config.enable_reduce_sample:
            check_reduce_sample_params(params)
        check_kv_transfer_params_accepted(params.extra_args, self.config.kv_transfer_config is not None)
        requests = self.input_processor.process(request_id, prompt, params, priority=priority)
        prompt_text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        self.output_processor.add_request(request_id, prompt_text, requests, params, output_kind=output_kind)
        num_added = 0
        try:
            for request in requests:
                self.engine_core.add_request(request)
                num_added += 1
        except BaseException:
            # The core refused one (n > 1: the others may be in): forget the whole request on both sides.
            self.output_processor.abort_requests([request_id])
            self.engine_core.abort_requests([request.request_id for request in requests[:num_added]])
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        engine_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(engine_outputs)
        if processed.request_ids_to_abort:
            # Stop strings are found here, after detokenization: finish those requests in the core.
            self.engine_core.abort_requests(processed.request_ids_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()
