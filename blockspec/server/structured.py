"""OpenAI `response_format` → the engine's grammar fields (SGLang names: json_schema, regex, ebnf)."""
from __future__ import annotations

import json
from typing import Any, Optional

from blockspec.request import JSON_OBJECT_SCHEMA


def response_format_schema(response_format: Optional[dict[str, Any]]) -> Optional[str]:
    """The JSON schema text a response_format asks for (None for plain text); ValueError for anything else.

    {"type": "json_object"} is any JSON object; {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    is that schema (OpenAI's shape)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("type json_schema needs a json_schema object: {\"name\": ..., \"schema\": {...}}")
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return json.dumps(schema)
    raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")
