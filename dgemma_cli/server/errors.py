"""Errors that carry an HTTP status: raised anywhere in the server, rendered by the app as `{"error": "..."}`.

The status travels the one way every `DgemmaError` carries it (`status`); these classes only fix its value.
"""
from dgemma_cli.errors import DgemmaError


class RequestError(DgemmaError):
    """A client error with its status code (the class's, 400, unless stated)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message


class NotFound(RequestError):
    status = 404


class ServerBusy(RequestError):
    """Ollama's exact queue-overflow text (two spaces), which clients match on."""

    status = 503

    def __init__(self) -> None:
        super().__init__("server busy, please try again.  maximum pending requests exceeded")


class ClientGone(RequestError):
    status = 499

    def __init__(self) -> None:
        super().__init__("request canceled")
