"""The bundled Sudoku model's task: puzzle parsing, checking and rendering, and `dgemma run sudoku PUZZLE`.

The model (recipes/sudoku/) reads the 81 cells through its chat template (one `<c{cell}={digit}>` token per cell) and
writes one 81-token canvas of digits. `run` recognises the model by that template (is_sudoku_model) and hands the run
to `run_sudoku` (a task renderer, see session.register_task_renderer):

- stdout not a terminal: exactly 9 lines of 9 digits, nothing else (a fixed interface; notes go to stderr);
- a terminal: the drawn grid; with `--visual` the grid denoising live, the given clues in bold.

A wrong grid is detectable (it breaks a rule), so `run` checks the answer and asks again, up to MAX_TRIES times: the
first try is the puzzle as given, each later one the same puzzle under a fresh random Symmetry (digits relabelled,
rows, columns, bands and stacks shuffled, maybe transposed), whose answer is mapped back. The model's mistakes on one
puzzle repeat under a new seed but mostly not under a new symmetry, which it sees as another puzzle; every digit still
comes from the model. The last grid is printed either way, with a warning on stderr when it is not a solution.

Tries run side by side when the model has several generation slots (its `PARAMETER num_parallel`): `first_solution`
hands out try indices in order and commits the lowest-index try that solves, so the answer is the one a sequential
run gives; tries after it are cancelled.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from dgemma_cli.errors import DgemmaError
from dgemma_engine.tasks import UNITS

if TYPE_CHECKING:
    from dgemma_cli.session import TaskContext

MODEL_GENERAL_NAME = "dgemma-sudoku"  # general.name of the bundled GGUF (bundle.py converts from a folder so named)
CELL_TOKEN_MARK = "<c{{ loop.index0 }}="  # the chat template's per-cell token: how `run` recognises the task
CANVAS = 81  # one canvas holds the whole answer (num_predict 81)
MAX_TRIES = 24  # a failed grid is retried under a new symmetry (bench: a solved medium puzzle takes ~7 tries)
USAGE_EXAMPLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"



# ---- puzzles and grids ----------------------------------------------------------------------------------------------

def parse_puzzle(text: str) -> str:
    """81 cells: digits 1-9, `0` or `.` for blanks, whitespace ignored -> 81 chars of '0'-'9'. Givens that already
    break a rule (the same digit twice in a row, column or box) are rejected too: no grid could solve them."""
    cells = "".join(text.split()).replace(".", "0")
    bad = sorted({ch for ch in cells if ch not in "0123456789"})
    if bad:
        raise DgemmaError(f"invalid sudoku puzzle: unexpected character {bad[0]!r} (use digits, '0' or '.' for blanks)")
    if len(cells) != CANVAS:
        raise DgemmaError(f"invalid sudoku puzzle: expected 81 cells, got {len(cells)}")
    for kind, number, unit in UNITS:
        givens = [cells[i] for i in unit if cells[i] != "0"]
        repeated = sorted({d for d in givens if givens.count(d) > 1})
        if repeated:
            raise DgemmaError(f"invalid sudoku puzzle: digit {repeated[0]} appears twice in {kind} {number}")
    return cells


def answer_grid(text: str) -> str:
    """The model's decoded canvas -> 81 chars; a missing or non-digit cell becomes '?' so it never passes as solved."""
    digits = [ch if ch in "123456789" else "?" for ch in "".join(text.split())[:CANVAS]]
    return "".join(digits).ljust(CANVAS, "?")


def is_solution(puzzle: str, grid: str) -> bool:
    """`grid` fills every cell with 1-9, keeps every given of `puzzle`, and each row, column and box has 9 digits."""
    if len(grid) != CANVAS or any(ch not in "123456789" for ch in grid):
        return False
    if any(p != "0" and p != g for p, g in zip(puzzle, grid)):
        return False
    return all(len({grid[i] for i in unit}) == 9 for _, _, unit in UNITS)


def prompt_text(puzzle: str) -> str:
    """What the model's chat template renders for a user message holding `puzzle` (bench and tests tokenize it)."""
    return "<bos>" + "".join(f"<c{cell}={digit}>" for cell, digit in enumerate(puzzle))


def plain_lines(grid: str) -> str:
    """Exactly 9 lines of 9 digits (the non-TTY output; a fixed interface). A cell the model left without a digit
    prints as 0, the puzzle's own blank mark."""
    digits = grid.replace("?", "0")
    return "\n".join(digits[r * 9:(r + 1) * 9] for r in range(9))


def grid_table(puzzle: str, grid: str, title: str | None = None, changed: Sequence[bool] | None = None) -> Table:
    """A drawn grid: givens bold, filled cells cyan (dim while still changing), 3x3 boxes separated."""
    table = Table(show_header=False, show_lines=False, box=None, padding=(0, 0), title=title)
    table.add_column(no_wrap=True)
    for r in range(9):
        if r in (3, 6):
            table.add_row(Text("------+-------+------", style="dim"))
        line = Text()
        for c in range(9):
            if c in (3, 6):
                line.append("| ", style="dim")
            i = r * 9 + c
            if puzzle[i] != "0":
                style = "bold" if grid[i] == puzzle[i] else "bold red"  # a clue the model failed to keep shows red
            elif changed is not None and changed[i]:
                style = "dim cyan"
            else:
                style = "cyan"
            line.append(grid[i], style=style)
            line.append(" ")
        table.add_row(line)
    return table


def print_grid(console: Console, puzzle: str, grid: str) -> None:
    console.print(grid_table(puzzle, grid))


@dataclass(frozen=True)
class Symmetry:
    """A transform that maps Sudoku solutions to Sudoku solutions: cell i of the transformed grid is cell `source[i]`
    of the original, its digit d written as `digits[d]` (0, a blank, stays 0; any other mark is kept)."""
    source: tuple[int, ...]
    digits: tuple[int, ...]

    @classmethod
    def identity(cls) -> Symmetry:
        return cls(tuple(range(CANVAS)), tuple(range(10)))

    @classmethod
    def random(cls, rng: random.Random) -> Symmetry:
        digits = (0, *rng.sample(range(1, 10), 9))
        rows = [band * 3 + r for band in rng.sample(range(3), 3) for r in rng.sample(range(3), 3)]
        cols = [stack * 3 + c for stack in rng.sample(range(3), 3) for c in rng.sample(range(3), 3)]
        if rng.random() < 0.5:
            source = tuple(cols[c] * 9 + rows[r] for r in range(9) for c in range(9))  # transposed
        else:
            source = tuple(rows[r] * 9 + cols[c] for r in range(9) for c in range(9))
        return cls(source, digits)

    def apply(self, grid: str) -> str:
        return "".join(self._digit(grid[s], self.digits) for s in self.source)

    def undo(self, grid: str) -> str:
        inverse = [0] * 10
        for d, image in enumerate(self.digits):
            inverse[image] = d
        out = ["?"] * CANVAS
        for i, s in enumerate(self.source):
            out[s] = self._digit(grid[i], inverse)
        return "".join(out)

    @staticmethod
    def _digit(ch: str, table: Sequence[int]) -> str:
        return str(table[int(ch)]) if ch in "0123456789" else ch


def attempt_symmetries(tries: int, seed: int | None) -> list[Symmetry]:
    """What each of `tries` attempts shows the model: the puzzle itself first, then fresh random symmetries (drawn
    from `seed`, so a seeded run repeats)."""
    rng = random.Random(seed)
    return [Symmetry.identity()] + [Symmetry.random(rng) for _ in range(tries - 1)]


# ---- tries side by side ----------------------------------------------------------------------------------------------

T = TypeVar("T")


@dataclass(frozen=True)
class Attempt:
    """One try as `first_solution` hands it out."""
    index: int  # 0 is the puzzle as given; the answer committed is the lowest index that solves
    worker: int  # which of the side-by-side workers runs it (the bench gives each its own K/V context)
    cancel: threading.Event  # set once a lower-index try has solved (or another failed): stop, the result is unused
    leading: Callable[[], bool]  # no lower-index try is still running: the one a live view shows


@dataclass(frozen=True)
class Outcome(Generic[T]):
    results: list[T]  # tries 0..k in order: tries before k failed, try k solved (or was the last)
    started: int  # tries begun, including cancelled ones after k

    @property
    def committed(self) -> T:
        return self.results[-1]


class _TryPool(Generic[T]):
    """first_solution's shared state: the next index to hand out, the running tries and the results kept."""

    def __init__(self, tries: int, solved: Callable[[T], bool]):
        self.tries, self.solved = tries, solved
        self.lock = threading.Lock()
        self.next = 0
        self.best: int | None = None  # lowest index known to solve
        self.results: dict[int, T] = {}
        self.running: dict[int, threading.Event] = {}
        self.error: BaseException | None = None

    def take(self) -> tuple[int, threading.Event] | None:
        with self.lock:
            if self.error is not None or self.next >= self.tries or (self.best is not None and self.next > self.best):
                return None
            index, self.next = self.next, self.next + 1
            self.running[index] = cancel = threading.Event()
            return index, cancel

    def finish(self, index: int, result: T) -> None:
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

    def abort(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error
            for cancel in self.running.values():
                cancel.set()

    def leading(self, index: int) -> bool:
        with self.lock:
            return all(other >= index for other in self.running)

    def work(self, worker: int, attempt: Callable[[Attempt], T]) -> None:
        try:
            while (taken := self.take()) is not None:
                index, cancel = taken
                result = attempt(Attempt(index, worker, cancel, lambda i=index: self.leading(i)))
                self.finish(index, result)
        except BaseException as exc:  # noqa: BLE001  (re-raised by first_solution in the caller's thread)
            self.abort(exc)

    def outcome(self) -> Outcome[T]:
        last = self.best if self.best is not None else self.tries - 1
        return Outcome([self.results[i] for i in range(last + 1)], self.next)


def first_solution(attempt: Callable[[Attempt], T], tries: int, workers: int,
                   solved: Callable[[T], bool]) -> Outcome[T]:
    """Run `attempt` for tries 0..tries-1 on `workers` threads, each taking the next index when it is free, until one
    solves. Every try before the committed one ran to its end, so the outcome is a sequential run's; a try after it
    that is still running sees its `cancel` set. `workers` 1 runs in the caller's thread."""
    pool: _TryPool[T] = _TryPool(tries, solved)
    if workers <= 1:
        pool.work(0, attempt)
    else:
        threads = [threading.Thread(target=pool.work, args=(w, attempt), name=f"sudoku-try-{w}", daemon=True)
                   for w in range(workers)]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException as exc:  # Ctrl-C while waiting: stop the tries in flight
            pool.abort(exc)
            raise
    if pool.error is not None:
        raise pool.error
    return pool.outcome()


# ---- solving through the engine directly (bench/sudoku.py, tests) ----------------------------------------------------

@dataclass(frozen=True)
class Solution:
    grid: str  # 81 chars, '?' where the canvas holds no digit
    steps: int  # denoising steps of the committed canvas
    seconds: float  # prefill + denoising
    candidate_steps: int = 0  # denoising steps summed over every candidate canvas (num_canvases)


def solve_with_engine(model: Any, tokenizer: Any, puzzle: str, params: Any, ctx: Any = None,
                      check: bool = False, cancel: threading.Event | None = None) -> Solution:
    """One generation of one canvas on a loaded `dgemma_engine` model (`params`: a SamplerParams, its num_canvases
    candidates included). `check`: as the server runs the task, with the Sudoku checker choosing among candidates and
    sending cells that break a rule back into denoising; else the plain model (the lowest-entropy candidate).
    `cancel` set: stop at the next step (a canvas not yet committed gives a grid of '?')."""
    from dgemma_engine.generate import CanvasEvent, StepEvent, eos_ids_from_metadata, generate
    from dgemma_engine.model import Context
    from dgemma_engine.tasks import task_checker

    prompt = tokenizer.encode(prompt_text(puzzle), special=True)
    own = ctx is None
    ctx = ctx if ctx is not None else Context(model, n_ctx=len(prompt) + CANVAS, threads=None,
                                              max_canvases=params.num_canvases)
    checker = task_checker(tokenizer.tokens, CANVAS, prompt) if check else None
    candidate_steps = 0
    try:
        ctx.reset()
        start = time.perf_counter()
        eos_ids = eos_ids_from_metadata(model.metadata)
        committed = None
        for event in generate(ctx, prompt, params, max_new_tokens=CANVAS, eos_ids=eos_ids, checker=checker,
                              cancel=cancel):
            if isinstance(event, StepEvent):
                candidate_steps += event.candidates
            elif isinstance(event, CanvasEvent):
                committed = event
        seconds = time.perf_counter() - start
    finally:
        if own:
            ctx.close()
    if committed is None:  # cancelled before the canvas was committed
        return Solution("?" * CANVAS, 0, seconds, candidate_steps)
    canvas = list(committed.canvas)
    if committed.eos_position is not None:  # as transformers: the EOS ends the answer (pad after it)
        canvas = canvas[:committed.eos_position]
    digits = "".join(_digit_of(tokenizer, t) for t in canvas)
    return Solution(digits.ljust(CANVAS, "?"), committed.steps, seconds, candidate_steps)


def _digit_of(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.tokens[token_id] if 0 <= token_id < len(tokenizer.tokens) else ""
    return text if len(text) == 1 and text in "123456789" else "?"


# ---- `dgemma run sudoku PUZZLE` -------------------------------------------------------------------------------------

def is_sudoku_model(show: dict[str, Any]) -> bool:
    """`/api/show` omits `general.name` (as Ollama does), so the task is recognised by what defines it: a chat
    template that writes one cell token per puzzle character, and a canvas of exactly 81 positions."""
    canvas = (show.get("model_info") or {}).get("diffusion.canvas_length")
    return canvas == CANVAS and CELL_TOKEN_MARK in str(show.get("template") or "")


def run_sudoku(context: TaskContext) -> bool:
    """The task renderer: handles the run when the model is the Sudoku model, else returns False."""
    if not is_sudoku_model(context.show):
        return False
    if context.prompt is None:
        raise DgemmaError(f"the sudoku model needs a puzzle: dgemma run {context.settings.model} PUZZLE "
                          f"(81 cells: digits, 0 or . for blanks; e.g. {USAGE_EXAMPLE})")
    puzzle = parse_puzzle(context.prompt)
    from dgemma_cli.ui import Spinner, is_tty

    tty = is_tty(sys.stdout)
    console = Console(file=sys.stdout) if tty else None
    view = LiveGrid(console, puzzle) if (tty and context.settings.visual) else None
    spinner = Spinner(sys.stderr, enabled=tty and view is None and is_tty(sys.stderr))
    user_seed = context.settings.options.get("seed")
    user_seed = None if user_seed is None else int(user_seed)
    symmetries = attempt_symmetries(MAX_TRIES, user_seed)

    def one_try(attempt: Attempt) -> tuple[str, int]:
        seed = None if user_seed is None else user_seed + attempt.index
        return _one_try(context, puzzle, symmetries[attempt.index], seed, attempt, view, spinner)

    try:
        spinner.start("solving")
        outcome = first_solution(one_try, MAX_TRIES, generation_slots(context.show),
                                 solved=lambda answer: is_solution(puzzle, answer[0]))
    finally:
        spinner.stop()
        if view is not None:
            view.stop()
    grid, tries, steps = outcome.committed[0], len(outcome.results), sum(used for _, used in outcome.results)
    solved = is_solution(puzzle, grid)
    if console is not None:
        print_grid(console, puzzle, grid)
    else:
        sys.stdout.write(plain_lines(grid) + "\n")
        sys.stdout.flush()
    if context.settings.verbose:
        print(f"tries: {tries}\ndenoising steps: {steps}", file=sys.stderr)
    if not solved:
        print(f"warning: the model's grid is not a valid solution ({tries} tries)", file=sys.stderr)
    return True


def generation_slots(show: dict[str, Any]) -> int:
    """How many generations the server runs at once for this model: its `PARAMETER num_parallel`, as `/api/show`
    lists it (1 when absent)."""
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "num_parallel":
            try:
                return max(1, int(value.strip()))
            except ValueError:
                return 1
    return 1


def _one_try(context: TaskContext, puzzle: str, symmetry: Symmetry, seed: int | None, attempt: Attempt,
             view: LiveGrid | None, spinner: Any) -> tuple[str, int]:
    """One generation over the REST API on `puzzle` under `symmetry`; returns (answer grid mapped back to `puzzle`,
    denoising steps). Closing the stream early (attempt.cancel) makes the server stop that generation."""
    from dgemma_cli.session import chunk_text, is_progress

    options = {"num_predict": CANVAS, **context.settings.options}
    options.pop("seed", None)
    if seed is not None:
        options["seed"] = seed
    options["diffusion_progress"] = True
    if view is not None:
        options["diffusion_preview"] = True
    body = {"model": context.settings.model, "prompt": symmetry.apply(puzzle), "options": options}
    if context.settings.keep_alive is not None:
        body["keep_alive"] = context.settings.keep_alive
    text, steps = "", 0
    chunks = context.client.generate_stream(body)
    try:
        for chunk in chunks:
            if attempt.cancel.is_set():
                break
            if chunk.get("done"):
                steps = int(chunk.get("denoise_steps") or steps)
            elif is_progress(chunk):
                steps = int(chunk.get("completed") or steps)
                if not attempt.leading():
                    continue
                counter = f"step {chunk.get('completed')}/{chunk.get('total')}"
                if attempt.index:
                    counter += f" · try {attempt.index + 1}"
                spinner.set(f"solving · {counter}")
                if view is not None and chunk.get("preview") is not None:
                    view.update(symmetry.undo(answer_grid(str(chunk["preview"]))), counter)
            else:
                text += chunk_text(chunk)[0]
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    return symmetry.undo(answer_grid(text)), steps


class LiveGrid:
    """`--visual`: the draft grid redrawn at each denoising step; cells that changed since the last step are dimmed."""

    def __init__(self, console: Console, puzzle: str):
        from rich.live import Live

        self.puzzle = puzzle
        self.previous = "?" * CANVAS
        self.live = Live(self._frame(self.previous, "starting"), console=console, refresh_per_second=20,
                         transient=True)
        self.live.start()

    def _frame(self, grid: str, counter: str) -> Group:
        changed = [a != b for a, b in zip(grid, self.previous)]
        return Group(grid_table(self.puzzle, grid, changed=changed), Text(counter, style="cyan"))

    def update(self, grid: str, counter: str) -> None:
        self.live.update(self._frame(grid, counter))
        self.previous = grid

    def stop(self) -> None:
        self.live.stop()
