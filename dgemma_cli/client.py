"""HTTP client of the dgemma REST API, as the CLI commands use it (docs/compat.md#cli-surface).

Commands get a `Client` from `local_server.connect()` (the server at `DGEMMA_HOST`, or one served in-process).
Streaming calls yield the server's NDJSON objects one by one; closing the generator (or a KeyboardInterrupt while
reading) closes the HTTP response, which is how the server learns to stop denoising. Every call goes through
`transport_errors`, so a network failure is one clear line, never a traceback.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from dgemma_cli import env, wire
from dgemma_cli.errors import DgemmaError

PROBE_TIMEOUT_S = 1.0
# Generations can take minutes per canvas on a CPU; only connecting is bounded.
STREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0)
CALL_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=600.0, pool=5.0)


class ApiError(DgemmaError):
    """An `{"error": ...}` answer (or line) from the server; `status` is the HTTP status (200 for mid-stream)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def client_base_url(environ: dict[str, str] | None = None) -> str:
    """The server URL from `DGEMMA_HOST`; unspecified bind addresses (0.0.0.0, ::) become loopback for connecting."""
    address = env.HOST.get(environ)
    host = address.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return f"{address.scheme}://{shown}:{address.port}"


def _error_text(response: httpx.Response) -> str:
    from dgemma_cli.wire import error_text  # pydantic's import cost only on the error path

    try:
        body = response.json()
    except (ValueError, json.JSONDecodeError):
        body = None
    message = error_text(body)
    if message is not None:
        return message
    text = response.text.strip()
    return text or f"server answered {response.status_code}"


@contextlib.contextmanager
def transport_errors(base_url: str, brief: bool = False) -> Iterator[None]:
    """Network failures (server gone, connection reset mid-stream) become one clear line, never a traceback.

    `brief`: the store commands' wording, `lost the connection to the dgemma server (<reason>)`, timeouts included."""
    try:
        yield
    except httpx.HTTPError as exc:
        if brief:
            raise DgemmaError(f"lost the connection to the dgemma server ({exc or type(exc).__name__})") from None
        if isinstance(exc, httpx.TimeoutException):
            raise DgemmaError(f"timed out waiting for the dgemma server at {base_url}") from None
        raise DgemmaError(f"lost the connection to the dgemma server at {base_url}: {exc or type(exc).__name__}") from None


@dataclass
class Client:
    base_url: str
    http: httpx.Client
    local: Any = None  # the local_server.LocalServer this command started, if it started one

    # ---- plain calls ---------------------------------------------------------------------------------------------

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise ApiError(_error_text(response), response.status_code)
        return response

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with transport_errors(self.base_url):
            response = self._check(self.http.post(path, json=body, timeout=CALL_TIMEOUT))
            return response.json() if response.content else {}

    def _get(self, path: str) -> dict[str, Any]:
        with transport_errors(self.base_url):
            return self._check(self.http.get(path)).json()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A plain call to an endpoint without a method here (the store client's), worded as the store commands
        report failures; an error answer raises ApiError."""
        with transport_errors(self.base_url, brief=True):
            return self._check(self.http.request(method, path, **kwargs))

    def version(self) -> dict[str, Any]:
        return self._get("/api/version")

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        return self._post("/api/show", {"model": model, "verbose": verbose})

    def ps(self) -> dict[str, Any]:
        return self._get("/api/ps")

    def generate(self, request: wire.GenerateRequest) -> dict[str, Any]:
        return self._post("/api/generate", {**wire.request_body(request), "stream": False})

    # ---- streams -------------------------------------------------------------------------------------------------

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with `stream: true` and yield each NDJSON object; an in-stream `{"error": ...}` raises ApiError."""
        with transport_errors(self.base_url), \
                self.http.stream("POST", path, json={**body, "stream": True}, timeout=STREAM_TIMEOUT) as response:
            if response.status_code >= 400:
                response.read()
                raise ApiError(_error_text(response), response.status_code)
            for line in response.iter_lines():
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    raise ApiError(f"unexpected response from the server: {line[:80]!r}") from None
                if isinstance(obj, dict) and "error" in obj:  # the wire's in-stream error line
                    from dgemma_cli.wire import error_text

                    message = error_text(obj)
                    raise ApiError(str(obj["error"]) if message is None else message, response.status_code)
                yield obj

    def generate_stream(self, request: wire.GenerateRequest) -> Iterator[dict[str, Any]]:
        return self.stream("/api/generate", wire.request_body(request))

    def chat_stream(self, request: wire.ChatRequest) -> Iterator[dict[str, Any]]:
        return self.stream("/api/chat", wire.request_body(request))

    def pull(self, model: str, insecure: bool = False) -> Iterator[dict[str, Any]]:
        return self.stream("/api/pull", {"model": model, "insecure": insecure})

    def create(self, request: wire.CreateRequest) -> Iterator[dict[str, Any]]:
        return self.stream("/api/create", wire.request_body(request))


def _headers() -> dict[str, str]:
    key = env.API_KEY.get()
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_client(base_url: str) -> httpx.Client:
    # Certificate loading costs a noticeable fraction of a CLI start; plain-http servers do not need it.
    return httpx.Client(base_url=base_url, headers=_headers(), timeout=CALL_TIMEOUT,
                        verify=base_url.startswith("https://"))


def server_answers(http: httpx.Client) -> bool:
    try:
        return http.head("/", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


