"""The one exception type the CLI and server turn into a clear one-line error (never a traceback)."""


class DgemmaError(Exception):
    """A user-facing error: bad input, unknown model, malformed file. The message is shown as is."""
