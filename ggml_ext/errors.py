"""The engine's one user-facing error type: the CLI prints it as a single `Error: ...` line and exits 1."""


class EngineError(Exception):
    """A model file that cannot be used (malformed, wrong architecture, missing or misshapen tensor), or a request
    the engine cannot serve (context full, token id out of range, out of memory)."""
