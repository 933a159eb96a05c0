"""Errors that carry an HTTP status: raised anywhere in the server, rendered by the app as `{"error": "..."}`."""
from dgemma_cli.errors import DgemmaError


class RequestError(DgemmaError):
    """A client error with its status code (400 unless stated)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message


class NotFound(RequestError):
    def __init__(self, message: str):
        super().__init__(message, 404)


class ServerBusy(RequestError):
    """Ollama's exact queue-overflow text (two spaces), which clients match on."""

    def __init__(self) -> None:
        super().__init__("server busy, please try again.  maximum pending requests exceeded", 503)


class ClientGone(RequestError):
    def __init__(self) -> None:
        super().__init__("request canceled", 499)
