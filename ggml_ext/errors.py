"""The one user-facing error base of dgemma's three packages (engine, converter, CLI and server), and the engine's type.

A `DgemmaError` is an error the user can act on: the CLI prints it as a single `Error: ...` line and exits 1, the
server answers `{"error": "..."}` with the error's `status` (docs/server.md, "Errors"). It lives here, in pure Python,
because the engine is the package every other one may import.
"""


class DgemmaError(Exception):
    """A user-facing error: bad input, unknown model, malformed file. The message is shown as is.

    `status` is the HTTP status the server answers with: a class attribute, which a subclass (or an instance, as
    `RequestError` does) sets to something other than 400."""

    status: int = 400


class EngineError(DgemmaError):
    """A model file that cannot be used (malformed, wrong architecture, missing or misshapen tensor), or a request
    the engine cannot serve (context full, token id out of range, out of memory)."""
