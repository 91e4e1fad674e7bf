"""The JSON schemas the structured-output tests and benchmark run: one per schema feature the issue names.

Strings and arrays are bounded so a small model's output always completes within the token budget.
"""
from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMA_SUITE: dict[str, dict[str, Any]] = {
    "nested_objects": {
        "type": "object",
        "properties": {"person": {"type": "object", "properties": {
            "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {
                "type": "string", "pattern": "[0-9]{5}"}}, "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"size": {"enum": ["small", "medium", "large"]}, "unit": {"const": "cm"}},
        "required": ["size", "unit"], "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                       "count": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
        "required": ["age", "score", "count"], "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "nickname": NAME,
                       "active": {"type": "boolean"}},
        "required": ["id", "active"], "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, NAME,
                                           {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False,
    },
    "ref": {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -50, "maximum": 50},
            "y": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x", "y"],
            "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1,
                                                                           "maximum": 900}},
                  "required": ["title", "pages"], "additionalProperties": False},
    },
}
