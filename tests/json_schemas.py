"""The six JSON schemas the structured-output tests and bench/structured.py exercise (None: any JSON object)."""

SCHEMAS = {
    "object-required": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"]},
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "numbers": {"type": "array", "items": {"type": "number"}},
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "boolean"}},
                                                      "required": ["b"]}}, "required": ["a"]},
    "strings": {"type": "array", "items": {"type": "string"}},
    "json": None,
}
