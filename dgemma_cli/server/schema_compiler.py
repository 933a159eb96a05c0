"""Structured output's compile step, done before a request queues for a generation slot (docs/generation.md,
"Structured output").

A request's JSON schema is compiled against its model's vocabulary, which is read from the model's GGUF without
loading weights (once per blob: blobs are content-addressed). The compile runs in a child process at low priority
(dgemma_engine.automata) that the request owns: when the client leaves, the child is killed; past
DGEMMA_SCHEMA_COMPILE_TIMEOUT seconds of CPU time it is killed and the request gets a one-line 400. At most
`parallel` such children run at once (two on a small machine, so one hostile schema does not make a valid one wait),
at the lowest CPU priority, so generations keep their speed.

"Any JSON object" is shared instead: it is the same for every request and costs tens of CPU seconds at the released
vocabulary, so it is compiled once per vocabulary, without that limit, and a request for it waits for that compile
rather than being refused. It is compiled into the disk cache in the background right after `/api/create` and
`/api/pull` store a model (which answer `success` without waiting for it: a create of a small model would otherwise
take seconds, most of them this compile), and when a model loads (a no-op when it is cached). Every automaton is kept in memory (the last CACHE_SIZE) and on disk (`<models>/cache/automata/`), so it is
compiled once per (vocabulary, schema), across restarts; the disk cache keeps at most DISK_CACHE_BYTES in
DISK_CACHE_FILES files, the least recently used going first ("any JSON object" last). A read-only server
(DGEMMA_READONLY) reads that cache but never writes to it: what it compiles stays in memory. Before an automaton is handed out, the constrained decoder's
index of it (dgemma_engine.constrained.decode_index: its runs of edges and token sets) is built in a thread, once per
automaton in memory, so a request's first canvas does not wait for it.
"""
import asyncio
import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgemma_cli import env
from dgemma_engine import gguf_keys

log = logging.getLogger("dgemma.server")

CACHE_SIZE = 8                  # automata kept in memory ("any JSON object" at 262k tokens is hundreds of MB)
# The disk cache's bound: "any JSON object" at 262k tokens is a 436 MiB file, kept for a few vocabularies; a schema's
# file is kilobytes to tens of MB. Only compiles that succeeded are written (a refusal is remembered in memory:
# REFUSALS).
DISK_CACHE_BYTES = 2 << 30
DISK_CACHE_FILES = 256
VOCABULARIES = 4                # vocabularies kept in memory, by GGUF path
REFUSALS = 256                  # (vocabulary, schema) pairs known to exceed the CPU limit: refused again at once
WALL_LIMIT_FACTOR = 30          # a compile starved of CPU by generations is given up after this × its CPU limit
VOCABULARY_KEYS = frozenset({gguf_keys.KEY_TOKENS, gguf_keys.KEY_TOKEN_TYPE})
BACKGROUND_CPU_LIMIT_S = 1800.0  # "any JSON object" takes ~45 CPU seconds at 262k tokens; a crafted vocabulary less


@dataclass(eq=False)
class _Compile:
    task: asyncio.Task
    shared: bool                # kept running when its requesters leave ("any JSON object")
    waiters: int = 0


class SchemaCompiler:
    """Compiled output formats for the requests, by (vocabulary digest, schema)."""

    def __init__(self, cache_dir: Path | None, cpu_limit_s: float, parallel: int | None = None,
                 read_only: bool = False, disk_bytes: int = DISK_CACHE_BYTES, disk_files: int = DISK_CACHE_FILES):
        """`read_only`: read `cache_dir`, never write there (a DGEMMA_READONLY server); `disk_bytes`, `disk_files`:
        the disk cache's bound."""
        self.cache_dir = cache_dir
        self.read_only = read_only
        self.disk_bytes = disk_bytes
        self.disk_files = disk_files
        self.cpu_limit_s = cpu_limit_s
        self._slots = asyncio.Semaphore(parallel or max(2, (os.cpu_count() or 1) // 2))
        self._background_slot = asyncio.Semaphore(1)
        self._vocabularies: OrderedDict[str, asyncio.Future] = OrderedDict()
        self._automata: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._objectless: set[str] = set()  # digests of vocabularies that cannot open an object (logged once)
        self._compiles: dict[tuple[str, str], _Compile] = {}
        self._background: set[asyncio.Task] = set()

    async def automaton(self, gguf_path: str | os.PathLike, schema: dict[str, Any] | None) -> Any:
        """The TokenAutomaton of `schema` (None: any JSON object) for the model in `gguf_path`. Raises
        ConstraintError (one line) for a schema that cannot be compiled or exceeds the limit. Cancelling the call
        (the client left) stops a compile that no other request waits for."""
        from dgemma_engine.automata import schema_key
        from dgemma_engine.constrained import VOCABULARY_CANNOT_WRITE, ConstraintError

        vocabulary = await self.vocabulary(gguf_path)
        key = (vocabulary.digest, schema_key(schema))
        if key in self._automata:
            self._automata.move_to_end(key)
            return self._automata[key]
        if key in self._refused:
            raise ConstraintError(self._refused[key])
        if schema is None and not self._writes_objects(vocabulary, gguf_path):
            raise ConstraintError(VOCABULARY_CANNOT_WRITE)
        job = self._compiles.get(key)
        if job is None:
            job = self._start(key, vocabulary, schema, shared=schema is None)
        job.waiters += 1
        try:
            return await asyncio.shield(job.task)
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.shared and not job.task.done():
                job.task.cancel()  # its requesters left: the child is killed

    def precompile(self, model: Any) -> None:
        """Start compiling "any JSON object" for a model that just loaded (a no-op when it is cached)."""
        path = getattr(model, "gguf_path", None)
        if path is not None:
            self._start_background(self._precompile(str(path)))

    def with_store_compile(self, produce: Callable[[threading.Event], Iterator[Any]],
                           stored_gguf: Callable[[], Any]) -> Callable[[threading.Event], Iterator[Any]]:
        """`produce` (a create's or a pull's status stream, run in a WorkerStream's thread), starting the compile of
        "any JSON object" into the disk cache for the model it stored just before its closing `success`, which does
        not wait for it. `stored_gguf()` gives that model's GGUF path (None: no model layer). Called on the event
        loop. The compile is the shared background one (idle priority, no request limit); one that fails, or a
        vocabulary that cannot write an object, is logged once and a `format` request then says why."""
        loop = asyncio.get_running_loop()

        def statuses(cancel: threading.Event) -> Iterator[Any]:
            held = None  # a `success` is passed on only when another status follows it (a create that pulls its base)
            for status in produce(cancel):
                if held is not None:
                    yield held
                    held = None
                if isinstance(status, dict) and status.get("status") == "success":
                    held = status
                else:
                    yield status
            if held is None:
                return
            if not cancel.is_set():
                self._store_compile(loop, stored_gguf)
            yield held

        return statuses

    async def store_compile_needed(self, gguf_path: str | os.PathLike) -> bool:
        """Whether "any JSON object" for the model in `gguf_path` is still to be compiled into the disk cache: there
        is a writable cache, the vocabulary can open an object, and the file is not there yet."""
        from dgemma_engine.automata import cache_file

        if self.cache_dir is None or self.read_only:
            return False
        vocabulary = await self.vocabulary(gguf_path)
        if not self._writes_objects(vocabulary, gguf_path):
            return False
        path = cache_file(self.cache_dir, vocabulary, None)
        return await asyncio.to_thread(_writable_dir, path.parent) and not await asyncio.to_thread(path.is_file)

    async def compile_into_cache(self, gguf_path: str | os.PathLike) -> bool:
        """Compile "any JSON object" for the model in `gguf_path` into the disk cache (store_compile_needed said
        so); True once done, ConstraintError when the compile fails."""
        from dgemma_engine.automata import cache_file, save_automaton, schema_key

        vocabulary = await self.vocabulary(gguf_path)
        automaton = self._automata.get((vocabulary.digest, schema_key(None)))
        if automaton is not None:  # compiled by this server, its file removed since
            path = cache_file(self.cache_dir, vocabulary, None)
            await asyncio.to_thread(save_automaton, path, automaton)
            await asyncio.to_thread(self._trim, path)
        else:
            await self.automaton(gguf_path, None)
        return True

    async def close(self) -> None:
        """Stop every compile (their children are killed)."""
        tasks = [job.task for job in self._compiles.values()] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def vocabulary(self, gguf_path: str | os.PathLike) -> Any:
        """The compile's view of the model's vocabulary (dgemma_engine.automata.Vocabulary), read once per GGUF."""
        path = str(gguf_path)
        future = self._vocabularies.get(path)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(read_vocabulary, path))
            future.add_done_callback(lambda done: self._forget_failed_read(path, done))
            self._vocabularies[path] = future
            while len(self._vocabularies) > VOCABULARIES:
                self._vocabularies.popitem(last=False)
        else:
            self._vocabularies.move_to_end(path)
        return await asyncio.shield(future)

    # ---- internals ------------------------------------------------------------------------------------------------

    def _forget_failed_read(self, path: str, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            if self._vocabularies.get(path) is done:
                del self._vocabularies[path]

    def _start(self, key: tuple[str, str], vocabulary: Any, schema: dict | None, shared: bool) -> _Compile:
        job = _Compile(asyncio.ensure_future(self._compile(key, vocabulary, schema, shared)), shared)
        self._compiles[key] = job
        job.task.add_done_callback(lambda task: self._finished(key, job, task))
        return job

    def _finished(self, key: tuple[str, str], job: _Compile, task: asyncio.Task) -> None:
        if self._compiles.get(key) is job:
            del self._compiles[key]
        if not task.cancelled():
            task.exception()  # retrieved here: a background compile's failure has no requester to see it

    async def _compile(self, key: tuple[str, str], vocabulary: Any, schema: dict | None, shared: bool) -> Any:
        from dgemma_engine.automata import CompileLimitExceeded, cache_file, load_automaton, mark_used
        from dgemma_engine.constrained import VOCABULARY_CANNOT_WRITE, ConstraintError, decode_index

        path = None if self.cache_dir is None else cache_file(self.cache_dir, vocabulary, schema)
        if path is not None:
            automaton = await asyncio.to_thread(load_automaton, path, vocabulary.n_tokens)
            if automaton is not None:
                if not self.read_only:
                    await asyncio.to_thread(mark_used, path)
                await asyncio.to_thread(decode_index, automaton)
                self._remember(key, automaton)
                return automaton
        cpu_limit_s = BACKGROUND_CPU_LIMIT_S if shared else self.cpu_limit_s
        out = None if self.read_only else path  # a read-only server's compile is kept in memory only
        async with self._background_slot if shared else self._slots:
            try:
                automaton = await self._run_child(schema, vocabulary, out, cpu_limit_s)
            except CompileLimitExceeded as exc:
                message = limit_message(exc, shared)
                if exc.kind == "CPU time":  # the same schema would take as long again; wall time depends on load
                    self._refuse(key, message)
                raise ConstraintError(message) from None
            except ConstraintError as exc:
                if str(exc) == VOCABULARY_CANNOT_WRITE:  # it would say so again: known once, refused at once
                    self._refuse(key, str(exc))
                raise
        if out is not None:
            await asyncio.to_thread(self._trim, out)
        await asyncio.to_thread(decode_index, automaton)
        self._remember(key, automaton)
        return automaton

    def _trim(self, written: Path) -> None:
        """Keep the disk cache within its bound after `written` entered it (in a worker thread)."""
        from dgemma_engine.automata import trim_cache

        if not written.is_file():  # the cache folder was not writable: the compile used a scratch file
            return
        removed = trim_cache(self.cache_dir, self.disk_bytes, self.disk_files, keep=(written,))
        if removed:
            log.debug("removed %d least recently used automata from the disk cache", len(removed))

    async def _run_child(self, schema: dict | None, vocabulary: Any, path: Path | None, cpu_limit_s: float) -> Any:
        from dgemma_engine.automata import compile_isolated

        stop = threading.Event()
        with contextlib.ExitStack() as scratch:
            if path is None or not _writable_dir(path.parent):  # no cache: the child's file only carries the result
                folder = scratch.enter_context(tempfile.TemporaryDirectory(prefix="dgemma-automaton-",
                                                                           ignore_cleanup_errors=True))
                path = Path(folder) / "automaton.npz"
            try:
                return await asyncio.to_thread(compile_isolated, schema, vocabulary, path, cpu_limit_s,
                                               cpu_limit_s * WALL_LIMIT_FACTOR, stop)
            finally:
                stop.set()  # when this wait was cancelled (the requester left, shutdown), the child is killed

    def _writes_objects(self, vocabulary: Any, gguf_path: str | os.PathLike) -> bool:
        """Whether some token opens a JSON object (the value's first byte): a vocabulary of digits alone (the Sudoku
        model) cannot write one, which is known here at once instead of after a compile. Logged once per vocabulary."""
        if any(written.startswith(b"{") for written in vocabulary.token_map):
            return True
        if vocabulary.digest not in self._objectless:
            self._objectless.add(vocabulary.digest)
            log.info("%s: no token opens a JSON object, so `format` is refused for it", os.path.basename(gguf_path))
        return False

    def _refuse(self, key: tuple[str, str], message: str) -> None:
        self._refused[key] = message
        while len(self._refused) > REFUSALS:
            self._refused.popitem(last=False)

    def _remember(self, key: tuple[str, str], automaton: Any) -> None:
        self._automata[key] = automaton
        self._automata.move_to_end(key)
        while len(self._automata) > CACHE_SIZE:
            self._automata.popitem(last=False)

    def _store_compile(self, loop: asyncio.AbstractEventLoop, stored_gguf: Callable[[], Any]) -> None:
        """In a create's or pull's worker thread: start the compile for the model it stored, in the background."""
        try:
            path = stored_gguf()
        except Exception as exc:  # noqa: BLE001 - the model is stored; a later request compiles on demand
            log.warning('no "any JSON object" automaton compiled for the new model: %s', exc)
            return
        if path is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
                loop.call_soon_threadsafe(self._start_background, self._compile_stored(str(path)))

    def _start_background(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _compile_stored(self, path: str) -> None:
        started = time.monotonic()
        try:
            if not await self.store_compile_needed(path):
                return
            await self.compile_into_cache(path)
        except Exception as exc:  # noqa: BLE001 - a request for it reports the same error itself
            log.info('no "any JSON object" automaton for %s: %s', os.path.basename(path), _first_line(exc))
            return
        log.info('"any JSON object" for %s compiled into the cache in %.1f s', os.path.basename(path),
                 time.monotonic() - started)

    async def _precompile(self, path: str) -> None:
        try:
            await self.automaton(path, None)
        except Exception as exc:  # noqa: BLE001 - a request for it reports the same error itself
            log.info('no "any JSON object" automaton for %s: %s', os.path.basename(path), _first_line(exc))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def read_vocabulary(path: str) -> Any:
    """The compile's view of the model in `path`, from its metadata alone (read with the GGUF check's parser: about a
    second for 262k tokens, where gguf's GGUFReader takes tens); ConstraintError when it has none."""
    from dgemma_engine.automata import Vocabulary
    from dgemma_engine.constrained import ConstraintError

    from dgemma_cli.gguf_check import read_gguf_info

    try:
        metadata = read_gguf_info(path, keep_arrays=VOCABULARY_KEYS).metadata
        return Vocabulary.from_metadata(metadata)
    except ConstraintError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store checked the file; this is one line either way
        raise ConstraintError(f"cannot read the model's vocabulary: {str(exc).splitlines()[0] if str(exc) else exc!r}")


def limit_message(exc: Any, shared: bool) -> str:
    """The one line a request gets for a compile stopped at its limit, naming the limit and what sets it."""
    setting = env.SCHEMA_COMPILE_TIMEOUT.name
    if exc.kind == "CPU time":
        where = "" if shared else f" ({setting})"
        return f"the JSON schema is too complex: compiling it takes more than {exc.seconds:g} s of CPU time{where}"
    where = "" if shared else f" ({WALL_LIMIT_FACTOR} × {setting})"
    return f"the JSON schema compile did not finish within {exc.seconds:g} s on this busy server{where}"


def _writable_dir(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)
