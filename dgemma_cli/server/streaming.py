"""Bridges between blocking work in threads and HTTP responses: worker streams, NDJSON/SSE responses, disconnects.

A generation runs in a worker thread that owns the model's lease and releases it when the loop ends, so the slot is
freed as soon as the generation stops: normally, or at the next denoising step after the client went away.
"""
import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.errors import ClientGone

log = logging.getLogger("dgemma.server")
T = TypeVar("T")

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
DISCONNECT_POLL_S = 0.25  # docs/compat.md#concurrency-and-lifecycle: poll non-streaming requests this often

# An absolute path (not a URL and not part of a name like `hf.co/user/repo`): replaced before text leaves the server.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:/[\w.@+~-]+)+/?")


def timestamp() -> str:
    """RFC 3339, UTC, 6 fractional digits and `+00:00` (invariant 4)."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def timestamp_of(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, UTC).isoformat(timespec="microseconds")


def scrub_paths(text: str) -> str:
    """No absolute server paths in anything a client sees (docs/compat.md, security C7)."""
    return _ABSOLUTE_PATH.sub("<path>", text)


def error_status(exc: BaseException) -> int:
    """The HTTP status of a failure: a user error's own `status` (400 unless it says otherwise), else 500."""
    return exc.status if isinstance(exc, DgemmaError) else 500


def is_user_error(exc: BaseException) -> bool:
    """Every package's user-facing error (engine and converter errors derive from `DgemmaError` too)."""
    return isinstance(exc, DgemmaError)


def error_message(exc: BaseException) -> str:
    if is_user_error(exc):
        return scrub_paths(str(exc)) or type(exc).__name__
    return "internal server error"


def json_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def sse_event(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class WorkerStream:
    """Runs `produce(cancel)` in a thread; iterate asynchronously over what it yields.

    `on_finish(failed)` runs on the event loop once the thread is done (the lease release). `stop()` asks the worker
    to stop at its next check (between denoising steps); if it never started, it finishes at once.
    """

    def __init__(self, produce: Callable[[threading.Event], Iterator[Any]], on_finish: Callable[[bool], None]):
        self.produce = produce
        self.on_finish = on_finish
        self.cancel = threading.Event()
        self.started = False
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def start(self) -> None:
        self.started = True
        threading.Thread(target=self._work, name="dgemma-generate", daemon=True).start()

    def _post(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def _work(self) -> None:
        failed = False
        try:
            for item in self.produce(self.cancel):
                self._post(("item", item))
                if self.cancel.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001  (reported to the client)
            failed = not is_user_error(exc)
            if failed:
                log.exception("generation failed")
            self._post(("error", exc))
        finally:
            self._post(("end", None))
            try:
                self._loop.call_soon_threadsafe(self._finish, failed)
            except RuntimeError:
                pass

    def _finish(self, failed: bool) -> None:
        if not self.finished:
            self.finished = True
            self.on_finish(failed)

    def stop(self) -> None:
        self.cancel.set()
        if not self.started:
            self._finish(False)

    async def __aiter__(self) -> AsyncIterator[Any]:
        if not self.started:
            self.start()
        while True:
            kind, value = await self._queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value


class GuardedStreamingResponse(StreamingResponse):
    """A streaming response that always runs `cleanup` (stop the worker), even if the body was never iterated."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None], media_type: str):
        super().__init__(content, media_type=media_type)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


def guarded_stream(stream: WorkerStream, frames: AsyncIterator[bytes], error_frame: Callable[[Exception], bytes],
                   media_type: str) -> GuardedStreamingResponse:
    """A streaming answer of `frames` from `stream`'s worker. After the first byte the status is sent, so a failure
    becomes one last frame (`error_frame`); the worker is stopped however the body ends."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames:
                yield frame
        except Exception as exc:  # noqa: BLE001  (reported in the stream itself)
            yield error_frame(exc)
        finally:
            stream.stop()
            close = getattr(frames, "aclose", None)
            if close is not None:
                await close()

    return GuardedStreamingResponse(body(), cleanup=stream.stop, media_type=media_type)


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` unless the client leaves first (polled every 250 ms): then cancel it, 499
    (docs/compat.md#concurrency-and-lifecycle)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client left while queued (499)")
                raise ClientGone()
    except BaseException:
        task.cancel()
        try:
            result = await task
        except BaseException:  # noqa: BLE001  (its outcome no longer matters)
            pass
        else:  # it finished just before the cancel landed: give back what it acquired
            release = getattr(result, "release", None)
            if release is not None:
                release()
        raise


async def collect(request: Request, stream: WorkerStream) -> list[Any]:
    """Gather a worker's whole output for a non-streaming answer, stopping it if the client leaves."""
    items: list[Any] = []

    async def gather() -> None:
        async for item in stream:
            items.append(item)

    try:
        await until_disconnected(request, gather())
    finally:
        stream.stop()
    return items


def stream_error_line(exc: BaseException) -> dict[str, str]:
    if not is_user_error(exc):
        log.debug("mid-stream error: %r", exc)
    return {"error": error_message(exc)}
