"""StructuredOutputsParams: what a request's output must match (vLLM's field names).

Pure Python: SamplingParams carries it across the process boundary as plain data.
"""
from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set.

    json: a JSON schema (dict or JSON text); regex: a regular expression the whole output matches;
    choice: the output is one of these strings; grammar: an EBNF/GBNF grammar whose start rule is `root`;
    json_object: any JSON object.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'nothing'}: exactly one of "
                             f"{list(STRUCTURED_OUTPUT_KINDS)} must be given")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema (a dict or JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of "
                                 f"non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be true or false")

    @property
    def kind(self) -> str:
        """The one field that is set."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema as canonical JSON, the regex, the grammar, the choices as JSON."""
        kind = self.kind
        if kind == "json":
            if isinstance(self.json, str):
                return self.json
            # Key order kept: JSON-schema properties are generated in the order given.
            return json_module.dumps(self.json, separators=(",", ":"))
        if kind == "choice":
            return json_module.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str]:
        """Requests with equal keys share one compiled grammar."""
        return (self.kind, self.spec)
