"""Network-exposure defences (docs/compat.md, security F, G): Host allowlist, Origin/CORS allowlist, bearer API key,
JSON body cap. One pure ASGI middleware, so streaming responses and disconnect detection pass through untouched.

Order matters: a rebinding Host or a foreign Origin is refused before anything else (403, empty body), then CORS
preflights are answered (browsers never send credentials on them), then the API key is checked.
"""
import hmac
import ipaddress
import json
import re
import socket
import urllib.parse
from collections.abc import Awaitable, Callable

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.wire import ErrorResponse, OpenAIError, OpenAIErrorBody, WireModel

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Origins a local browser app may legitimately have (docs/compat.md, security F18); ports are free.
_DEFAULT_ORIGINS = tuple(
    f"{scheme}://{host}{port}"
    for scheme in ("http", "https")
    for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
    for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
_LOCAL_NAME_SUFFIXES = (".localhost", ".local", ".internal")
_CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
_CORS_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, X-Stainless-Lang, X-Stainless-Package-Version, X-Stainless-OS, X-Stainless-Arch, X-Stainless-Runtime, X-Stainless-Runtime-Version, X-Stainless-Async, X-Stainless-Retry-Count, X-Stainless-Timeout"


def _own_interface_addresses() -> set[str]:
    addresses = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            addresses.add(str(info[4][0]).split("%")[0])
    except OSError:
        pass
    return addresses


def split_host_header(value: str) -> str:
    """The host part of a Host header value (`name`, `name:port`, `[v6]:port`), lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        return value.split(":")[0]
    return value


class HostPolicy:
    """Which Host headers a loopback-bound server accepts: local names and non-public addresses only (DNS rebinding)."""

    def __init__(self, config: ServerConfig):
        self.enforce = config.host.is_loopback
        self.extra = {name.lower() for name in config.allowed_hosts}
        self.hostname = socket.gethostname().lower()
        self.own_addresses = _own_interface_addresses()

    def allows(self, host_header: str | None) -> bool:
        if not self.enforce or not host_header:
            return True
        host = split_host_header(host_header).rstrip(".")
        if host in ("localhost", self.hostname) or host in self.extra or host.endswith(_LOCAL_NAME_SUFFIXES):
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip.is_loopback or ip.is_private or ip.is_unspecified or host in self.own_addresses


class OriginPolicy:
    """Allowed browser origins: local apps plus `DGEMMA_ORIGINS` (`*` wildcards). Never `*` by default."""

    def __init__(self, config: ServerConfig):
        # Only `*` is a wildcard (so `[::1]` stays literal); it matches any run of characters.
        self.patterns = tuple(
            re.compile(re.escape(p.lower()).replace(r"\*", ".*")) for p in _DEFAULT_ORIGINS + tuple(config.origins)
        )

    def allows(self, origin: str) -> bool:
        canonical = _canonical_origin(origin.strip().lower())
        return canonical is not None and any(pattern.fullmatch(canonical) for pattern in self.patterns)


def _canonical_origin(origin: str) -> str | None:
    """`scheme://host[:port]` of a well-formed origin, else None: user info (`http://localhost:@evil.example`),
    a path, query or fragment, or a port that is not a number would let a `*` in a pattern match a foreign host."""
    try:
        parts = urllib.parse.urlsplit(origin)
        parts.port  # noqa: B018 (raises ValueError for a non-numeric or out-of-range port)
    except ValueError:
        return None
    if not parts.scheme or "@" in parts.netloc or parts.path or parts.query or parts.fragment or "#" in origin:
        return None
    if origin != f"{parts.scheme}://{parts.netloc}":
        return None  # anything urlsplit normalised away (`?`, stray characters) is not an origin either
    return origin


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_simple(send: Send, status: int, body: bytes = b"", headers: list | None = None) -> None:
    head = list(headers or [])
    if body:
        head.append((b"content-type", b"application/json; charset=utf-8"))
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def error_body(path: str, status: int, message: str) -> bytes:
    """`{"error": "..."}` natively, the OpenAI error object under `/v1` (docs/compat.md#openai-layer)."""
    if path.startswith("/v1/"):
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "api_error")
        payload: WireModel = OpenAIError(error=OpenAIErrorBody(message=message, type=kind))
    else:
        payload = ErrorResponse(error=message)
    return json.dumps(payload.wire()).encode()


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app = app
        self.config = config
        self.hosts = HostPolicy(config)
        self.origins = OriginPolicy(config)
        self.api_key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.hosts.allows(_header(scope, b"host")):
            await _send_simple(send, 403)
            return
        origin = _header(scope, b"origin")
        cors_headers: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not self.origins.allows(origin):
                await _send_simple(send, 403)
                return
            cors_headers = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
            ]
            if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
                await _send_simple(
                    send,
                    204,
                    headers=cors_headers
                    + [
                        (b"access-control-allow-methods", _CORS_METHODS.encode()),
                        (b"access-control-allow-headers", _CORS_HEADERS.encode()),
                        (b"access-control-max-age", b"600"),
                    ],
                )
                return
        path = scope.get("path", "")
        if self.api_key is not None and not (path == "/" and scope["method"] in ("GET", "HEAD")):
            if not self._authorized(_header(scope, b"authorization")):
                await _send_simple(send, 401, error_body(path, 401, "unauthorized"), cors_headers)
                return
        if cors_headers:
            send = _with_headers(send, cors_headers)
        if scope["method"] in ("POST", "PUT", "PATCH", "DELETE") and not path.startswith("/api/blobs/"):
            buffered = await _read_capped_body(receive, self.config.max_json_body)
            if buffered is _CLIENT_LEFT:  # mid-body (or its body stalled past DGEMMA_BODY_TIMEOUT): nobody to answer
                return
            if buffered is None:
                await _send_simple(send, 413, error_body(path, 413, "request body too large"))
                return
            receive = _replay(buffered, receive)
        await self.app(scope, receive, send)

    def _authorized(self, header: str | None) -> bool:
        if not header or not header[:7].lower() == "bearer ":
            return False
        return hmac.compare_digest(header[7:].strip().encode("utf-8", "replace"), self.api_key)


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = list(message.get("headers", [])) + extra
        await send(message)

    return wrapped


_CLIENT_LEFT = b"<client left>"  # a sentinel compared by identity


async def _read_capped_body(receive: Receive, cap: int) -> bytes | None:
    """The whole request body, None once it exceeds `cap` bytes (JSON bodies are small; docs/compat.md, security
    G21), or `_CLIENT_LEFT` when the client went away before sending all of it."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return _CLIENT_LEFT
        body = message.get("body", b"")
        size += len(body)
        if size > cap:
            return None
        chunks.append(body)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the app once, then pass through (so disconnects are still seen)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
