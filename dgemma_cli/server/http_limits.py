"""The HTTP server's defences against slow and numerous clients (docs/server.md#connections).

uvicorn has a keep-alive timeout but no limit on how long a request head or body may take, and no connection limit:
20,000 sockets that each send half a head take every file descriptor, and asyncio then logs a traceback for every
failed accept. Here, on top of uvicorn's h11 protocol (subclassed, not copied):

- a request head must be complete within `header_timeout` of the connection opening (or of the previous answer on a
  keep-alive connection), else the connection is closed (408 when part of a head arrived);
- a request body may pause at most `body_timeout` between chunks, and a JSON body must arrive whole within it (blob
  uploads, which may be many GB, only have the pause limit); a pause while the server itself is not reading (flow
  control, or a client waiting for `100 Continue`) does not count;
- at most `max_connections` are open, fewer than the open-file limit so the store and the models always have file
  descriptors: a new connection beyond it closes the oldest connection still waiting for a request head (a slow
  client's), or when every connection is busy with a request, is answered 503 and closed;
- these events, and accept errors such as EMFILE, are logged once per burst (`BurstLog`), never once per connection.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dgemma.server")

FD_RESERVE = 256  # file descriptors kept free of connections: models, store files, the schema compiler's pipes
BURST_WINDOW_S = 10.0  # like events within this window make one log line
_ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_BUSY_BODY = b'{"error":"server busy: too many open connections"}'
_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(_BUSY_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _BUSY_BODY)


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit where allowed; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in ((hard,) if hard != resource.RLIM_INFINITY else (1 << 20, 10240)):  # macOS: OPEN_MAX
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (OSError, ValueError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def accept_backlog(fd_limit: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go before any of them reaches
    the connection limit: uvicorn's 2048, lowered under a small open-file limit."""
    if fd_limit == resource.RLIM_INFINITY:
        return 2048
    return max(16, min(2048, fd_limit // 8))


def connection_cap(configured: int, fd_limit: int, backlog: int) -> int:
    """`configured` connections, lowered so that those, plus what one accept burst and the closes it causes hold
    (3 backlogs), leave `FD_RESERVE` descriptors free (a quarter of a small limit at least)."""
    if fd_limit == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, max(fd_limit - FD_RESERVE - 3 * backlog, fd_limit // 4)))


class BurstLog:
    """One log line per burst of like events: the first is logged at once; those within the next `window` seconds
    are counted and summarised in one line when the window ends."""

    def __init__(self, level: int, message: str, window: float = BURST_WINDOW_S):
        self.level, self.message, self.window = level, message, window
        self.last = float("-inf")
        self.suppressed = 0
        self.flush_scheduled = False

    def event(self, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last >= self.window:
            self.last = now
            log.log(self.level, self.message, *args)
            return
        self.suppressed += 1
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_later(self.last + self.window - now, self._flush, args)

    def _flush(self, args: tuple) -> None:
        self.flush_scheduled = False
        if self.suppressed:
            log.log(self.level, self.message + " (%d more times in %.0f s)", *args, self.suppressed, self.window)
            self.suppressed = 0
            self.last = time.monotonic()


@dataclass
class HttpLimits:
    """What one server enforces, and its shared connection bookkeeping."""

    header_timeout: float
    body_timeout: float
    max_connections: int

    def __post_init__(self) -> None:
        self.open: set[LimitedH11Protocol] = set()
        self.awaiting_head: dict[LimitedH11Protocol, None] = {}  # insertion order: the oldest first
        self.evicted = BurstLog(logging.WARNING, "connection limit (%d) reached: closing the oldest connections "
                                "still waiting for a request head")
        self.refused = BurstLog(logging.WARNING, "connection limit (%d) reached with every connection busy: new "
                                "connections are answered 503")
        self.head_timeouts = BurstLog(logging.INFO, "closed connections that sent no complete request head within "
                                      "%g s (DGEMMA_HEADER_TIMEOUT)")
        self.body_timeouts = BurstLog(logging.INFO, "closed connections whose request body stalled for %g s "
                                      "(DGEMMA_BODY_TIMEOUT)")
        self.accept_errors = BurstLog(logging.WARNING, "cannot accept connections: %s")

    def admit(self, protocol: "LimitedH11Protocol") -> bool:
        """Room for one more connection, made by closing the oldest one waiting for its head if need be."""
        if len(self.open) >= self.max_connections:
            if not self.awaiting_head:
                self.refused.event(self.max_connections)
                return False
            victim = next(iter(self.awaiting_head))
            self.evicted.event(self.max_connections)
            victim.close_idle()
        self.open.add(protocol)
        return True

    def forget(self, protocol: "LimitedH11Protocol") -> None:
        self.open.discard(protocol)
        self.awaiting_head.pop(protocol, None)

    def loop_exception_handler(self, previous: Any) -> Any:
        """An event-loop exception handler that logs accept errors (EMFILE...) once per burst, no traceback; asyncio
        retries the accept by itself."""

        def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS and "accept" in context.get("message", ""):
                self.accept_errors.event(exc.strerror or str(exc))
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        return handler


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body timeouts and the connection limit of `limits` (set on the
    per-server subclass `protocol_class` makes)."""

    limits: HttpLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline: float | None = None  # a JSON body must be whole by then
        self._last_body_data = 0.0
        self._cycle_seen: Any = None  # the request whose head was seen last: a new cycle means a new head

    # -- asyncio.Protocol --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.limits.admit(self):
            self._refused = True
            transport.write(_503)
            transport.close()
            return
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_head_timer()
        self._cancel_body_timer()
        self.limits.forget(self)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.cycle is self._cycle_seen:  # no pipelined head was parsed: the next one is awaited from now
            self._await_head()
        self._track()

    # -- the limits --------------------------------------------------------------------------------------------------

    def close_idle(self) -> None:
        """Close a connection that is waiting for a request head (the connection limit needs its descriptor)."""
        self.limits.forget(self)
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _await_head(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
        self.limits.awaiting_head.pop(self, None)
        self.limits.awaiting_head[self] = None

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.limits.awaiting_head.pop(self, None)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.limits.awaiting_head.pop(self, None)
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head arrived: tell the client why, as Go's server does not
            self.transport.write(_408)
        self.limits.head_timeouts.event(self.limits.header_timeout)
        self.transport.close()

    def _track(self) -> None:
        """After bytes arrived or an answer ended: a newly parsed head stops the head timer; a body being received
        keeps the body timer running."""
        if self.transport.is_closing():
            return
        if self.cycle is not self._cycle_seen:
            self._cycle_seen = self.cycle
            self._cancel_head_timer()
            blob = self.cycle.scope["path"].startswith("/api/blobs/")
            self._body_deadline = None if blob else self.loop.time() + self.limits.body_timeout
        if self.conn.their_state is h11.SEND_BODY:
            self._last_body_data = self.loop.time()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout, self._check_body)
        else:
            self._cancel_body_timer()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        now = self.loop.time()
        if self.flow.read_paused or (self.cycle is not None and self.cycle.waiting_for_100_continue):
            self._last_body_data = now  # the server is not reading: the client cannot be blamed for the pause
        idle_until = self._last_body_data + self.limits.body_timeout
        due = min(idle_until, self._body_deadline) if self._body_deadline is not None else idle_until
        if now < due:
            self._body_timer = self.loop.call_later(due - now, self._check_body)
            return
        if self.cycle is not None and not self.cycle.response_started:
            self.transport.write(_408)
        self.limits.body_timeouts.event(self.limits.body_timeout)
        self.transport.close()  # the app sees the client leave (`http.disconnect`)


def protocol_class(limits: HttpLimits) -> type[LimitedH11Protocol]:
    return type("DgemmaH11Protocol", (LimitedH11Protocol,), {"limits": limits})


class LimitedServer(uvicorn.Server):
    """uvicorn's server with accept errors logged once per burst."""

    def __init__(self, config: uvicorn.Config, limits: HttpLimits):
        super().__init__(config)
        self.limits = limits

    async def startup(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self.limits.loop_exception_handler(loop.get_exception_handler()))
        await super().startup(sockets=sockets)


def limited_server(app: Any, server_config: Any, **uvicorn_options: Any) -> LimitedServer:
    """A uvicorn server of `app` under the limits of `server_config` (a ServerConfig), on the h11 protocol (pinned:
    the limits hook into it) without WebSocket upgrades (no route takes them; an upgraded connection would leave the
    protocol that keeps the count)."""
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    backlog = accept_backlog(fd_limit)
    limits = HttpLimits(server_config.header_timeout, server_config.body_timeout,
                        connection_cap(server_config.max_connections, fd_limit, backlog))
    config = uvicorn.Config(app, http=protocol_class(limits), ws="none", backlog=backlog, **uvicorn_options)
    return LimitedServer(config, limits)
