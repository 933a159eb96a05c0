"""The task layer: every request to a task model (its GGUF names a task, dgemma_engine.tasks) runs as that task, so
every client, `dgemma run` included, gets the same answers.

1. The task's input is read from the rendered prompt (`TaskRequest.read`; Sudoku: the puzzle in the 81 cell tokens
   the template writes for the latest message). A prompt without one is a 400 before the first byte.
2. Up to `task_tries` tries (a settings row: request option or Modelfile PARAMETER): the first on the input as given,
   each later one under a fresh random symmetry of it (drawn from the request's seed, so a seeded request repeats),
   its answer mapped back. A try is one canvas denoised with the task's checker, which chooses among candidate
   canvases and renoises cells that break a rule (self-correction, dgemma_engine.generate).
3. Tries run side by side on the model's generation slots that are free (`num_parallel`), each on its own K/V context.
   The answer is the lowest-numbered try that passes, so it is the one a sequential run gives; later tries stop.
4. `done_reason` is "stop" when the answer passes the rules, else "length" (every try ran out: the answer is the last
   try's, which breaks a rule). Progress chunks carry `task_try` and follow the lowest try still running; the final
   metrics count the tries up to the answer (`task_tries`, and one canvas each).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from dgemma_cli.server import answers
from dgemma_cli.server.answers import Final, Plan, Text
from dgemma_cli.server.options import SamplerSettings
from dgemma_cli.server.runner import Runner
from dgemma_cli.wire import Metrics, Progress
from dgemma_engine.tasks import (SUDOKU_CELLS, SudokuTask, Symmetry, answer_grid, attempt_symmetries, is_solution,
                                 task_for)

T = TypeVar("T")


# ---- tries side by side ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One try as a TryPool hands it out."""
    index: int  # 0 is the input as given; the answer committed is the lowest index that solves
    worker: int  # which of the side-by-side workers runs it
    cancel: threading.Event  # set once a lower-index try has solved (or the request ended): stop, the result is unused
    leading: Callable[[], bool]  # no lower-index try is still running: the one progress follows


@dataclass(frozen=True)
class Outcome(Generic[T]):
    results: list[T]  # tries 0..k in order: tries before k failed, try k solved (or was the last)
    started: int  # tries begun, including cancelled ones after k

    @property
    def committed(self) -> T:
        return self.results[-1]


class TryPool(Generic[T]):
    """Runs `attempt` for tries 0..tries-1 on workers that each take the next index when free, until one solves.
    Every try before the committed one ran to its end, so the outcome is a sequential run's; a try after it that is
    still running sees its `cancel` set."""

    def __init__(self, attempt: Callable[[Attempt], T], tries: int, solved: Callable[[T], bool]):
        self.attempt, self.tries, self.solved = attempt, tries, solved
        self.lock = threading.Lock()
        self.next = 0
        self.best: int | None = None  # lowest index known to solve
        self.results: dict[int, T] = {}
        self.running: dict[int, threading.Event] = {}
        self.error: BaseException | None = None

    def run(self, workers: int) -> Outcome[T]:
        """Blocks until done; `workers` 1 runs in the caller's thread. Re-raises what a try (or `abort`) raised."""
        if workers <= 1:
            self._work(0)
        else:
            threads = [threading.Thread(target=self._work, args=(w,), name=f"task-try-{w}", daemon=True)
                       for w in range(workers)]
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join()
            except BaseException as exc:  # Ctrl-C while waiting (bench): stop the tries in flight
                self.abort(exc)
                raise
        if self.error is not None:
            raise self.error
        last = self.best if self.best is not None else self.tries - 1
        return Outcome([self.results[i] for i in range(last + 1)], self.next)

    def abort(self, error: BaseException) -> None:
        """Stop every running try and hand out no more; `run` raises `error`."""
        with self.lock:
            if self.error is None:
                self.error = error
            for cancel in self.running.values():
                cancel.set()

    def _take(self) -> tuple[int, threading.Event] | None:
        with self.lock:
            if self.error is not None or self.next >= self.tries or (self.best is not None and self.next > self.best):
                return None
            index, self.next = self.next, self.next + 1
            self.running[index] = cancel = threading.Event()
            return index, cancel

    def _finish(self, index: int, result: T) -> None:
        with self.lock:
            del self.running[index]
            if self.best is not None and index > self.best:
                return
            self.results[index] = result
            if self.solved(result):
                self.best = index
                for later, cancel in self.running.items():
                    if later > index:
                        cancel.set()

    def _leading(self, index: int) -> bool:
        with self.lock:
            return all(other >= index for other in self.running)

    def _work(self, worker: int) -> None:
        try:
            while (taken := self._take()) is not None:
                index, cancel = taken
                result = self.attempt(Attempt(index, worker, cancel, lambda i=index: self._leading(i)))
                self._finish(index, result)
        except BaseException as exc:  # noqa: BLE001  (re-raised by run in the caller's thread)
            self.abort(exc)


def first_solution(attempt: Callable[[Attempt], T], tries: int, workers: int,
                   solved: Callable[[T], bool]) -> Outcome[T]:
    return TryPool(attempt, tries, solved).run(workers)


# ---- one request to a task model -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskRequest:
    """A request's input as the model's task reads it."""
    task: SudokuTask
    head: list[int]  # the prompt before the puzzle's cells
    puzzle: str

    @classmethod
    def read(cls, runner: Runner, prompt_ids: list[int]) -> TaskRequest | None:
        """None for a text model; the task's one-line error (a 400) for a prompt that holds no input."""
        task = task_for(runner.metadata)
        if task is None:
            return None
        head, puzzle = task.read_prompt(prompt_ids)
        return cls(task, head, puzzle)


@dataclass(frozen=True)
class TryResult:
    grid: str  # the answer mapped back to the request's puzzle; '?' where the canvas holds no digit
    final: Final | None  # None: the try was cancelled


class _Cancelled(Exception):
    """The request ended (client gone) while tries ran."""


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


def _progress_as_asked(progress: Progress, symmetry: Symmetry, index: int) -> Progress:
    """A try's step in the request's own cells (its draft mapped back), tagged with the 1-based try."""
    out = progress.model_copy(update={"task_try": index + 1})
    if progress.preview is not None:
        out.preview = symmetry.undo(answer_grid(progress.preview))
    tokens, accepted = progress.preview_tokens, progress.preview_accepted
    if tokens is not None:  # one digit per cell, else dropped (the client then compares `preview` between steps)
        per_cell = len(tokens) == SUDOKU_CELLS and all(len(t) == 1 for t in tokens)
        out.preview_tokens = list(symmetry.undo(answer_grid("".join(tokens)))) if per_cell else None
    if accepted is not None:
        out.preview_accepted = symmetry.undo_positions(accepted) if len(accepted) == SUDOKU_CELLS else None
    return out


def run_task(runner: Runner, plan: Plan, sampler: SamplerSettings, cancel: threading.Event, request: TaskRequest,
             workers: int, started: float, load_seconds: float = 0.0) -> Iterator[Text | Progress | Final]:
    """Yield what clients see of a task request: progress of the leading try, then the answer and its Final. Nothing
    final is yielded when `cancel` (the client left) stops the tries."""
    symmetries = attempt_symmetries(sampler.task_tries, sampler.seed)
    events: queue.Queue = queue.Queue()
    done = object()
    task_start = time.perf_counter()

    def attempt(a: Attempt) -> TryResult:
        symmetry = symmetries[a.index]
        shown = symmetry.apply(request.puzzle)
        try_plan = replace(plan, prompt_ids=request.task.prompt(request.head, shown),
                           checker=request.task.checker(shown), max_new_tokens=runner.canvas_length,
                           token_limit=None, constraint=None)  # the answer is one canvas
        try_sampler = replace(sampler, seed=None if sampler.seed is None else sampler.seed + a.index, stop=())
        text, final = "", None
        for item in answers.run_generation(runner, try_plan, try_sampler, a.cancel):
            if isinstance(item, Progress):
                if a.leading():
                    events.put(_progress_as_asked(item, symmetry, a.index))
            elif isinstance(item, Text):
                text += item.text
            elif isinstance(item, Final):
                final = item
        return TryResult(symmetry.undo(answer_grid(text)), final)

    pool = TryPool(attempt, sampler.task_tries, solved=lambda r: is_solution(request.puzzle, r.grid))
    box: dict[str, Any] = {}

    def drive() -> None:
        try:
            box["outcome"] = pool.run(workers)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the worker stream's thread)
            box["error"] = exc
        finally:
            events.put(done)

    driver = threading.Thread(target=drive, name="task-tries", daemon=True)
    driver.start()
    try:
        while True:
            if cancel.is_set():
                pool.abort(_Cancelled())
            try:
                item = events.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is done:
                break
            yield item
    finally:
        if driver.is_alive():  # the stream was closed early: stop the tries
            pool.abort(_Cancelled())
        driver.join()
    error = box.get("error")
    if isinstance(error, _Cancelled) or cancel.is_set():
        return
    if error is not None:
        raise error
    outcome: Outcome[TryResult] = box["outcome"]
    answer = outcome.committed.grid.replace("?", "0")  # a cell left without a digit shows as the puzzle's blank mark
    yield Text(text=answer)
    finals = [r.final for r in outcome.results if r.final is not None]
    last = outcome.committed.final
    now = time.perf_counter()
    prompt_ns = last.metrics.prompt_eval_duration if last is not None else 0
    metrics = Metrics(
        total_duration=_ns(now - started),
        load_duration=_ns(load_seconds),
        prompt_eval_count=len(plan.prompt_ids),
        prompt_eval_duration=prompt_ns,
        eval_count=len(answer),
        eval_duration=max(0, _ns(now - task_start) - prompt_ns),
        denoise_steps=sum(f.metrics.denoise_steps for f in finals),
        canvases=len(outcome.results),
        task_tries=len(outcome.results),
    )
    reason = "stop" if is_solution(request.puzzle, outcome.committed.grid) else "length"
    yield Final(done_reason=reason, metrics=metrics, context=plan.prompt_ids + runner.tokenize(answer))
