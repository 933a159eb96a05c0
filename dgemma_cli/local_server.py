"""The server a one-shot command talks to: the one at `DGEMMA_HOST`, or the same app served in this process.

`connect()` probes `HEAD /` at `DGEMMA_HOST`; when nothing answers it serves the FastAPI app in-process on an
ephemeral loopback port for the duration of the command, so `run`, `ps`, `stop` and the store commands have exactly
one code path and no daemon is left behind. This is the one place where the CLI side starts server code; the client
modules themselves (`client.py`, `store_client.py`) never import `dgemma_cli.server`.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from dgemma_cli.client import Client, client_base_url, http_client, server_answers
from dgemma_cli.errors import DgemmaError

LOCAL_START_TIMEOUT_S = 30.0


class LocalServer:
    """The REST app served by uvicorn in a daemon thread on `127.0.0.1:<ephemeral>` (bound before the thread starts,
    so there is no port race). Store pruning is left to `dgemma serve`: a one-shot command must not delete files."""

    def __init__(self, models_dir: str | None = None) -> None:
        """models_dir: serve this store instead of DGEMMA_MODELS' (benchmarks and tests)."""
        from dgemma_cli.hosts import HostAddress
        from dgemma_cli.server.app import create_app
        from dgemma_cli.server.config import ServerConfig
        from dgemma_cli.server.http_limits import limited_server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        port = self.sock.getsockname()[1]
        config = ServerConfig.from_env()
        config.host = HostAddress("http", "127.0.0.1", port)
        config.noprune = True
        if models_dir is not None:
            config.models_dir = str(models_dir)
        if not config.debug:
            # The command's own output is what the user reads: failures reach it as the server's `{"error": ...}`
            # answers, so the server's log lines (and their tracebacks) are not printed as well.
            server_log = logging.getLogger("dgemma.server")
            server_log.addHandler(logging.NullHandler())
            server_log.propagate = False
        self.url = f"http://127.0.0.1:{port}"
        # A server for one command: a background "any JSON object" compile at load would rarely finish before it ends
        # (a `run --format json` compiles it on request, as the background compile would). `create` and `pull` are
        # unaffected: they compile it into the store's cache as their last step, so the file is there when they return.
        app = create_app(config, precompile_formats=False)
        self.server = limited_server(app, config, log_level="debug" if config.debug else "critical", lifespan="on",
                                     timeout_graceful_shutdown=2)
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
def connect(say: Any = None) -> Iterator[Client]:
    """A client of the server at DGEMMA_HOST, or of an in-process one started for the duration of the block.

    `say(text)` (optional) is told which of the two it is (`--verbose`).
    """
    base_url = client_base_url()
    local = None
    http = http_client(base_url)
    if not server_answers(http):
        http.close()
        local = LocalServer()
        local.start()
        if say:
            say(f"no dgemma server at {base_url}; started one in-process at {local.url}")
        base_url = local.url
        http = http_client(base_url)
    elif say:
        say(f"using the dgemma server at {base_url}")
    try:
        yield Client(base_url, http, local)
    finally:
        http.close()
        if local is not None:
            local.stop()
