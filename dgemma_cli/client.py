"""HTTP client of the dgemma REST API, as the CLI commands use it (spec ollama-compat.md §1).

`connect()` probes `HEAD /` at `DGEMMA_HOST`; when nothing answers it serves the same FastAPI app in-process on an
ephemeral loopback port for the duration of the command, so `run`, `ps` and `stop` have exactly one code path and no
daemon is left behind. Streaming calls yield the server's NDJSON objects one by one; closing the generator (or a
KeyboardInterrupt while reading) closes the HTTP response, which is how the server learns to stop denoising.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError

PROBE_TIMEOUT_S = 1.0
LOCAL_START_TIMEOUT_S = 30.0
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
    try:
        body = response.json()
    except (ValueError, json.JSONDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # OpenAI shape
        return str(body["error"].get("message", ""))
    text = response.text.strip()
    return text or f"server answered {response.status_code}"


class LocalServer:
    """The REST app served by uvicorn in a daemon thread on `127.0.0.1:<ephemeral>` (bound before the thread starts,
    so there is no port race). Store pruning is left to `dgemma serve`: a one-shot command must not delete files."""

    def __init__(self) -> None:
        import uvicorn

        from dgemma_cli.server.app import create_app
        from dgemma_cli.server.config import HostAddress, ServerConfig

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        port = self.sock.getsockname()[1]
        config = ServerConfig.from_env()
        config.host = HostAddress("http", "127.0.0.1", port)
        config.noprune = True
        if not config.debug:
            # The command's own output is what the user reads: failures reach it as the server's `{"error": ...}`
            # answers, so the server's log lines (and their tracebacks) are not printed as well.
            server_log = logging.getLogger("dgemma.server")
            server_log.addHandler(logging.NullHandler())
            server_log.propagate = False
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="debug" if config.debug else "critical",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="dgemma-local-server",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + LOCAL_START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise DgemmaError("could not start the in-process dgemma server")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@contextlib.contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    """Network failures (server gone, connection reset mid-stream) become one clear line, never a traceback."""
    try:
        yield
    except httpx.TimeoutException:
        raise DgemmaError(f"timed out waiting for the dgemma server at {base_url}") from None
    except httpx.HTTPError as exc:
        raise DgemmaError(f"lost the connection to the dgemma server at {base_url}: {exc or type(exc).__name__}") from None


@dataclass
class Client:
    base_url: str
    http: httpx.Client
    local: LocalServer | None = None  # set when this command started its own server

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

    def version(self) -> dict[str, Any]:
        return self._get("/api/version")

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        return self._post("/api/show", {"model": model, "verbose": verbose})

    def ps(self) -> dict[str, Any]:
        return self._get("/api/ps")

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/api/generate", {**body, "stream": False})

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
                if isinstance(obj, dict) and "error" in obj:
                    raise ApiError(str(obj["error"]), response.status_code)
                yield obj

    def generate_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/generate", body)

    def chat_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/chat", body)

    def pull(self, model: str, insecure: bool = False) -> Iterator[dict[str, Any]]:
        return self.stream("/api/pull", {"model": model, "insecure": insecure})

    def create(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/create", body)


def _headers() -> dict[str, str]:
    key = env.API_KEY.get()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _http_client(base_url: str) -> httpx.Client:
    # Certificate loading costs a noticeable fraction of a CLI start; plain-http servers do not need it.
    return httpx.Client(base_url=base_url, headers=_headers(), timeout=CALL_TIMEOUT,
                        verify=base_url.startswith("https://"))


def server_answers(http: httpx.Client) -> bool:
    try:
        return http.head("/", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def connect(say: Any = None) -> Iterator[Client]:
    """A client of the server at DGEMMA_HOST, or of an in-process one started for the duration of the block.

    `say(text)` (optional) is told which of the two it is (`--verbose`).
    """
    base_url = client_base_url()
    local = None
    http = _http_client(base_url)
    if not server_answers(http):
        http.close()
        local = LocalServer()
        local.start()
        if say:
            say(f"no dgemma server at {base_url}; started one in-process at {local.url}")
        base_url = local.url
        http = _http_client(base_url)
    elif say:
        say(f"using the dgemma server at {base_url}")
    try:
        yield Client(base_url, http, local)
    finally:
        http.close()
        if local is not None:
            local.stop()
