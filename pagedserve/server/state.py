"""ServerState: what every endpoint handler shares (the engine, names, limits, metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.config.tool_calling import ToolCallingConfig
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.server.errors import OpenAIError
from pagedserve.server.limits import check_admission
from pagedserve.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_names: list[str]
    metrics: ServerMetrics
    max_waiting_requests: int
    tool_calling: ToolCallingConfig = field(default_factory=ToolCallingConfig)
    is_shutting_down: bool = False
    # Set when the engine died: the launcher exits non-zero once the server has stopped.
    engine_dead_error: EngineDeadError | None = field(default=None)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The served name a request asked for (None: the default); 404 for a model not served."""
        if requested is None or requested in self.served_model_names:
            return requested or self.model_name
        raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves "
                               f"{self.served_model_names}", param="model")

    def admit(self, num_engine_requests: int) -> None:
        """Refuse (503) while shutting down or after the engine died; 429 beyond the waiting bound."""
        if self.is_shutting_down:
            raise OpenAIError(503, "the server is shutting down")
        if self.engine.is_dead:
            raise OpenAIError(503, f"the engine is dead: {self.engine.dead_error}")
        check_admission(self.engine.num_engine_requests, num_engine_requests, self.engine.max_num_seqs,
                        self.max_waiting_requests)
