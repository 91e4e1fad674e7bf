"""Front-end checks of a structured-output constraint, so bad input is an error before the engine sees it.

A JSON schema must be valid JSON, build a grammar in xgrammar, and use only keywords xgrammar enforces:
a keyword it would accept but silently ignore (`not`, `uniqueItems`, `if`/`then`/`else`, ...) would let
outputs through that do not validate, so it is refused. A regex and an EBNF grammar must compile; a
regex's error names the position. Results are cached per distinct constraint.
"""
from __future__ import annotations

import functools
import importlib.util
import json
from typing import TYPE_CHECKING, Any

from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.config.engine import EngineConfig

# JSON-schema keywords xgrammar 0.2 accepts without enforcing (checked against its grammars).
UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "uniqueItems", "if", "then", "else", "dependentRequired",
                               "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "contains",
                               "minContains", "maxContains")


def validate_structured_outputs(params: StructuredOutputsParams, field_name: str = "structured_outputs") -> None:
    """Raise ValueError naming `field_name` (the request field the constraint came from) when the
    constraint cannot be enforced: invalid JSON or schema, an unsupported schema keyword, a regex or
    grammar that does not compile."""
    kind, spec = params.cache_key
    message = _constraint_error(kind, spec)
    if message is not None:
        raise ValueError(f"{field_name}: {message}")


@functools.lru_cache(maxsize=1024)
def _constraint_error(kind: str, spec: str) -> str | None:
    """The reason the constraint is refused, or None. Pure in (kind, spec): cached."""
    import xgrammar

    try:
        if kind == "json":
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as error:
                return f"the JSON schema is not valid JSON: {error}"
            if not isinstance(schema, (dict, bool)):
                return f"the JSON schema must be a JSON object, got {type(schema).__name__}"
            unsupported = _unsupported_keyword(schema, "#")
            if unsupported is not None:
                keyword, path = unsupported
                return (f"the JSON schema keyword {keyword!r} at {path} is not supported (it would not be "
                        f"enforced); unsupported keywords: {list(UNSUPPORTED_SCHEMA_KEYWORDS)}")
            xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec)
    except RuntimeError as error:
        return f"the {_KIND_NAMES[kind]} is invalid or unsupported: {_backend_message(error)}"
    return None


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list",
               "json_object": "JSON object constraint"}


def _backend_message(error: Exception) -> str:
    """xgrammar's message without its '[time] file.cc:line:' prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    marker = text.find(": ", text.find(".cc:"))
    return text[marker + 2:] if ".cc:" in text and marker >= 0 else text


def _unsupported_keyword(schema: Any, path: str) -> tuple[str, str] | None:
    """The first unsupported keyword in `schema` with its JSON pointer, or None.

    Walks every sub-schema; a property *named* like a keyword (under `properties`) is not a keyword.
    `multipleOf` is supported for integers only; `allOf` with more than one member is not merged."""
    if isinstance(schema, list):
        for index, item in enumerate(schema):
            found = _unsupported_keyword(item, f"{path}/{index}")
            if found is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for keyword in UNSUPPORTED_SCHEMA_KEYWORDS:
        if keyword in schema:
            return keyword, path
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "multipleOf", path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", path
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            if isinstance(value, dict):
                for name, sub_schema in value.items():
                    found = _unsupported_keyword(sub_schema, f"{path}/{key}/{name}")
                    if found is not None:
                        return found
        elif key in ("enum", "const", "default", "examples", "required"):
            continue  # values, not schemas
        elif isinstance(value, (dict, list)):
            found = _unsupported_keyword(value, f"{path}/{key}")
            if found is not None:
                return found
    return None


def structured_outputs_refusal(config: EngineConfig) -> str | None:
    """Why an engine with `config` cannot constrain outputs, or None when it can."""
    if importlib.util.find_spec("xgrammar") is None:
        return ("the grammar engine xgrammar is not installed; install it with "
                "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2")
    if config.parallel_config.enable_reduce_sample:
        return "enable_reduce_sample=True samples from gathered candidates, which a bitmask cannot mask"
    return None
