"""`dgemma serve` (alias `start`): the Ollama/OpenAI-compatible REST server, configured by `DGEMMA_*` variables."""
import errno
import logging
import shutil
import socket
import sys
import textwrap
from typing import Optional

import typer

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise DgemmaError(
                f"listen {where}: address already in use (set DGEMMA_HOST to choose another address)"
            ) from None
        raise DgemmaError(f"listen {where}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def startup_warnings(config) -> list[str]:
    """The loud warnings of docs/compat.md#commands: a non-loopback bind, and then a missing API key."""
    warnings = list(config.warnings)
    if not config.host.is_loopback:
        warnings.append(
            f"WARNING: dgemma is listening on {config.host.url}, a non-loopback address: anyone who can reach this "
            "machine can use it"
        )
        if not config.api_key:
            warnings.append("WARNING: DGEMMA_API_KEY is unset: requests from the network are not authenticated")
    return warnings


def use_rpc_servers(rpc: str | None, log: logging.Logger) -> None:
    """`--rpc host:port,...` (else DGEMMA_RPC): the ggml RPC servers the engine adds when it loads a model."""
    import os

    from dgemma_engine.devices import RPC_ENV, is_loopback_or_private, parse_endpoints
    from dgemma_engine.errors import EngineError

    text = rpc if rpc is not None else os.environ.get(RPC_ENV, "")
    try:
        endpoints = parse_endpoints(text)
    except EngineError as exc:
        raise DgemmaError(str(exc)) from None
    os.environ[RPC_ENV] = ",".join(endpoints)
    for endpoint in endpoints:
        log.info("RPC server %s: its devices take layers like GPUs (docs/engine.md#rpc)", endpoint)
        if not is_loopback_or_private(endpoint):
            log.warning("WARNING: RPC server %s is not on loopback or a private network: ggml RPC is unauthenticated "
                        "and unencrypted", endpoint)


def serve(
    rpc: Optional[str] = typer.Option(None, "--rpc", help="ggml RPC servers host:port,... (DGEMMA_RPC); "
                                      "unauthenticated: loopback or a private network only"),
) -> None:
    """Start the REST server (Ollama and OpenAI compatible). Configure it with the environment variables below."""
    from dgemma_cli.server.app import create_app
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.server.http_limits import limited_server, raise_open_file_limit

    config = ServerConfig.from_env()
    level = logging.DEBUG if config.debug else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    log = logging.getLogger("dgemma.server")
    for line in config.describe():
        log.info("config %s", line)
    for warning in startup_warnings(config):
        log.warning(warning)
    use_rpc_servers(rpc, log)
    # Generation runs in worker threads; a shorter GIL switch interval lets the event loop answer health, tags and
    # show requests promptly while Python code of the generation loop runs (the default 5 ms adds up under load).
    sys.setswitchinterval(0.001)
    fd_limit = raise_open_file_limit()  # room for connections; the cap below keeps descriptors for the store
    sock = _bind(config.host.host, config.host.port)
    app = create_app(config)
    server = limited_server(app, config, log_level="debug" if config.debug else "warning",
                            access_log=bool(config.debug), timeout_graceful_shutdown=5, lifespan="on")
    log.info("connections: at most %d open (open-file limit %d), request heads within %g s, bodies pausing at most "
             "%g s", server.limits.max_connections, fd_limit, config.header_timeout, config.body_timeout)
    log.info("listening on %s (dgemma API, Ollama %s compatible)", config.host.url, config.compat_version)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def environment_help(width: int) -> str:
    """`serve --help`'s list of the variables a server reads (`env.SERVE`): name, meaning and default, each wrapped
    under its own name to `width` columns (Rich markup escaped)."""
    from rich.markup import escape

    name_width = max(len(var.name) for var in env.SERVE)
    lines = ["Environment variables:"]
    for var in env.SERVE:
        default = "" if var.shown_default in ("", "off", "unset") else f" (default {var.shown_default})"
        lines += textwrap.wrap(var.description.replace("`", "") + default, width,
                               initial_indent=f"  {var.name:<{name_width}}  ", subsequent_indent=" " * (name_width + 4))
    return escape("\n".join(lines))


def register(app: typer.Typer) -> None:
    help_width = shutil.get_terminal_size().columns - 2  # Rich pads the epilog by one column on each side
    app.command("serve", epilog=environment_help(help_width))(serve)
    app.command("start", hidden=True, epilog=environment_help(help_width))(serve)
