"""The one exception type the CLI and server turn into a clear one-line error (never a traceback).

It is the same class for all three packages (defined with the engine, docs/server.md "Errors"), so a converter or
engine error is a `DgemmaError` too.
"""
from dgemma_engine.errors import DgemmaError

__all__ = ["DgemmaError", "out_of_range"]


def out_of_range(field: str) -> DgemmaError:
    """The one wording for a number its field cannot hold (request bodies, options, `keep_alive`; a 400)."""
    return DgemmaError(f"invalid value for {field}: number out of range")
