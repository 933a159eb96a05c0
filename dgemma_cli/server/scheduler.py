"""Model residency and admission (docs/compat.md#concurrency-and-lifecycle).

- Admission: a request counts as *pending* from arrival until it holds a generation slot (waiting for a load, for a
  free resident place, or for the model's slot). More than `DGEMMA_MAX_QUEUE` pending → 503 with Ollama's text. Waiters
  are served FIFO: asyncio's Condition and Semaphore wake waiters in arrival order.
- Residency: at most `DGEMMA_MAX_LOADED_MODELS` runners; loading beyond that evicts the idle runner whose keep-alive
  ends first, or waits while all are busy. A runner whose refcount drops to 0 expires after its `keep_alive`
  (0 = at once, FOREVER = never); a new request cancels the timer.
- Up to `num_parallel` generations at once per model (`DGEMMA_NUM_PARALLEL` slots, or the model's own `PARAMETER
  num_parallel`; 1 by default), each on a context of its own.
  Generations run in worker threads; the lease is released by the worker when it finishes, so a cancelled generation
  frees the slot at its next denoising step.
"""
import asyncio
import contextlib
import copy
import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError, ServerBusy
from dgemma_cli.server.options import PLACEMENT_OPTIONS
from dgemma_cli.server.runner import Runner

log = logging.getLogger("dgemma.server")

RunnerFactory = Callable[[Any, int], Runner]  # (LocalModel, num_ctx) -> Runner; blocking, called in a thread
FAR_FUTURE_SECONDS = 290 * 365.25 * 86400  # what `ps` shows for "forever", as Ollama (Go's max time.Duration)
_ticket: contextvars.ContextVar["_Ticket | None"] = contextvars.ContextVar("dgemma_pending_ticket", default=None)


def generation_slots(model: Any, default: int) -> int:
    """Concurrent generations for `model`: its Modelfile's `num_parallel` (checked at create), else the server's."""
    value = (getattr(model, "parameters", None) or {}).get("num_parallel")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def placed_model(local: Any, placement: dict[str, int]) -> Any:
    """The stored model with a request's placement options as its parameters: what the runner loads with, and what
    runners are told apart by (`model_identity`)."""
    parameters = dict(getattr(local, "parameters", None) or {})
    if all(parameters.get(name) == value for name, value in placement.items()):
        return local
    placed = copy.copy(local)
    placed.parameters = {**parameters, **placement}
    return placed


def model_identity(model: Any) -> tuple:
    """Two requests share a runner only if they name the same weights and settings."""
    parameters = getattr(model, "parameters", None) or {}
    placement = tuple(parameters.get(name) for name in PLACEMENT_OPTIONS)
    return (str(getattr(model, "gguf_path", "")), getattr(model, "manifest_digest", None), placement)


@dataclass(eq=False)
class Resident:
    name: str
    model: Any  # the store's LocalModel
    num_ctx: int
    keep_alive: float
    slots: asyncio.Semaphore
    ready: asyncio.Future
    runner: Runner | None = None
    refcount: int = 0  # requests holding or waiting for a slot
    expired: bool = False  # unload as soon as the refcount reaches 0
    expires_at: float | None = None  # wall clock, while idle with a timer
    timer: asyncio.TimerHandle | None = None
    load_seconds: float = 0.0
    loaded_at: float = field(default_factory=time.time)

    def matches(self, model: Any, num_ctx: int) -> bool:
        return model_identity(self.model) == model_identity(model) and self.num_ctx == num_ctx

    def expiry_for_ps(self, now: float) -> float:
        if self.refcount == 0 and self.expires_at is not None:
            return self.expires_at
        return now + min(self.keep_alive, FAR_FUTURE_SECONDS)


class Lease:
    """A held generation slot on a resident model. `release()` is idempotent and must run on the event loop."""

    def __init__(self, scheduler: "Scheduler", resident: Resident, load_seconds: float):
        assert resident.runner is not None
        self.scheduler = scheduler
        self.resident = resident
        self.runner: Runner = resident.runner
        self.load_seconds = load_seconds
        self.released = False

    def release(self, failed: bool = False) -> None:
        if self.released:
            return
        self.released = True
        if failed:  # a crashed worker: the next request reloads
            self.resident.expired = True
        self.resident.slots.release()
        self.scheduler._unref(self.resident)


class _Ticket:
    """One pending request (counted against DGEMMA_MAX_QUEUE until released)."""

    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler
        self.released = False
        scheduler.pending += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.scheduler.pending -= 1


class Scheduler:
    def __init__(self, config: ServerConfig, runner_factory: RunnerFactory,
                 on_loaded: Callable[[Any], None] | None = None):
        self.config = config
        self.factory = runner_factory
        self.on_loaded = on_loaded  # called on the event loop with the store's model once its runner is ready
        self.residents: dict[str, Resident] = {}
        self.pending = 0
        self._changed: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # created lazily, inside the server's event loop
            self._changed = asyncio.Condition()
        return self._changed

    @contextlib.contextmanager
    def admission(self) -> Iterator[None]:
        """Count an inference request as pending from its arrival (before the model lookup), so that a burst beyond
        the queue limit is refused at once and cheaply. `acquire` inside this block ends the count when it gets a
        slot (a running request is no longer pending), or the block's end does."""
        if self.pending >= self.config.max_queue:
            raise ServerBusy()
        ticket = _Ticket(self)
        token = _ticket.set(ticket)
        try:
            yield
        finally:
            _ticket.reset(token)
            ticket.release()

    async def acquire(self, name: str, model: Any, num_ctx: int, keep_alive: float | None,
                      placement: dict[str, int] | None = None) -> Lease:
        """Wait (FIFO) for `model` to be resident with `num_ctx` and `placement` (a request's num_gpu, num_cpu_moe) and
        for one of its slots. 503 when the queue is full."""
        model = placed_model(model, placement or {})
        ticket = _ticket.get()
        if ticket is None or ticket.released:
            if self.pending >= self.config.max_queue:
                raise ServerBusy()
            ticket = _Ticket(self)
        try:
            resident, loaded_here = await self._resident_for(name, model, num_ctx, keep_alive)
            try:
                await self._wait_loaded(resident)
                await resident.slots.acquire()
            except BaseException:
                self._unref(resident)
                raise
        finally:
            ticket.release()
        if keep_alive is not None:  # a request's value replaces the model's residency setting
            resident.keep_alive = keep_alive
        return Lease(self, resident, resident.load_seconds if loaded_here else 0.0)

    async def spare_leases(self, lease: Lease, wanted: int) -> list[Lease]:
        """Up to `wanted` more slots of `lease`'s model that are free now, never waiting and never taking one a queued
        request waits for: a task model's request runs its tries side by side on them (server/tasks.py)."""
        resident, spare = lease.resident, []
        while len(spare) < wanted and not resident.slots.locked():
            await resident.slots.acquire()  # free and nobody queued: returns at once
            resident.refcount += 1
            spare.append(Lease(self, resident, 0.0))
        return spare

    async def _resident_for(self, name: str, model: Any, num_ctx: int, keep_alive: float | None) -> tuple[Resident, bool]:
        async with self.changed:
            while True:
                resident = self.residents.get(name)
                if resident is not None and not resident.expired and resident.matches(model, num_ctx):
                    resident.refcount += 1
                    self._cancel_timer(resident)
                    return resident, False
                if resident is not None:  # other weights or num_ctx: reload once its users are done
                    resident.expired = True
                    if resident.refcount == 0 and resident.ready.done():
                        await self._unload_locked(resident)
                    else:
                        await self.changed.wait()
                    continue
                if len(self.residents) >= self.config.max_loaded_models:
                    idle = [r for r in self.residents.values() if r.refcount == 0 and r.ready.done()]
                    if idle:
                        victim = min(idle, key=lambda r: r.expires_at if r.expires_at is not None else math.inf)
                        await self._unload_locked(victim)
                    else:
                        await self.changed.wait()
                    continue
                loop = asyncio.get_running_loop()
                resident = Resident(
                    name=name,
                    model=model,
                    num_ctx=num_ctx,
                    keep_alive=self.config.keep_alive if keep_alive is None else keep_alive,
                    slots=asyncio.Semaphore(generation_slots(model, self.config.num_parallel)),
                    ready=loop.create_future(),
                    refcount=1,
                )
                self.residents[name] = resident
                self._spawn(self._load(resident))
                return resident, True

    async def _load(self, resident: Resident) -> None:
        started = time.perf_counter()
        try:
            runner = await asyncio.to_thread(self.factory, resident.model, resident.num_ctx)
        except BaseException as exc:  # noqa: BLE001  (reported to every waiter)
            resident.ready.set_exception(exc)
            resident.ready.exception()  # mark retrieved: waiters re-raise it themselves
            async with self.changed:
                if self.residents.get(resident.name) is resident:
                    del self.residents[resident.name]
                self.changed.notify_all()
            return
        resident.runner = runner
        resident.load_seconds = time.perf_counter() - started
        resident.loaded_at = time.time()
        resident.ready.set_result(None)
        log.info("loaded %s in %.2fs", resident.name, resident.load_seconds)
        if self.on_loaded is not None:
            self.on_loaded(resident.model)
        if resident.refcount == 0:
            self._unref_idle(resident)

    async def _wait_loaded(self, resident: Resident) -> None:
        timeout = self.config.load_timeout if self.config.load_timeout > 0 else None
        try:
            await asyncio.wait_for(asyncio.shield(resident.ready), timeout)
        except TimeoutError:
            raise RequestError("timed out waiting for model to load", 500) from None

    def _unref(self, resident: Resident) -> None:
        resident.refcount -= 1
        if resident.refcount == 0:
            self._unref_idle(resident)
        self._spawn(self._notify())

    def _unref_idle(self, resident: Resident) -> None:
        if not resident.ready.done():
            return
        if resident.expired or resident.keep_alive <= 0 or resident.ready.exception() is not None:
            self._spawn(self._expire(resident))
        elif math.isinf(resident.keep_alive):
            resident.expires_at = None
        else:
            resident.expires_at = time.time() + resident.keep_alive
            loop = asyncio.get_running_loop()
            resident.timer = loop.call_later(resident.keep_alive, lambda: self._spawn(self._expire(resident)))

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _expire(self, resident: Resident) -> None:
        async with self.changed:
            if resident.refcount == 0 and self.residents.get(resident.name) is resident:
                await self._unload_locked(resident)

    async def _unload_locked(self, resident: Resident) -> None:
        self._cancel_timer(resident)
        if self.residents.get(resident.name) is resident:
            del self.residents[resident.name]
        if resident.runner is not None:
            runner, resident.runner = resident.runner, None
            await asyncio.to_thread(runner.close)
            log.info("unloaded %s", resident.name)
        self.changed.notify_all()

    @staticmethod
    def _cancel_timer(resident: Resident) -> None:
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        resident.expires_at = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def unload(self, name: str) -> None:
        """`keep_alive: 0` on a load request / `stop`: unload now if idle, else once in-flight work finishes."""
        async with self.changed:
            resident = self.residents.get(name)
            if resident is None:
                return
            resident.expired = True
            if resident.refcount == 0 and resident.ready.done():
                await self._unload_locked(resident)

    def running(self) -> list[Resident]:
        """Loaded runners for `/api/ps`, latest expiry first."""
        now = time.time()
        loaded = [r for r in self.residents.values() if r.runner is not None]
        return sorted(loaded, key=lambda r: r.expiry_for_ps(now), reverse=True)

    async def shutdown(self) -> None:
        async with self.changed:
            for resident in list(self.residents.values()):
                resident.expired = True
                if resident.ready.done():
                    await self._unload_locked(resident)
