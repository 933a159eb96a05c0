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

# Schemas whose compile never ends (a DFA that explodes, huge bounded repetitions): the server refuses each with a 400
# at DGEMMA_SCHEMA_COMPILE_TIMEOUT (tests/test_schema_compile.py, tests/fuzz_api.py).
HOSTILE_SCHEMAS = {
    "pattern-blowup": {"type": "string", "pattern": "^(a|b)*a(a|b){24}$"},
    "min-length": {"type": "string", "minLength": 100000},
    "min-items": {"type": "array", "minItems": 5000},
}
