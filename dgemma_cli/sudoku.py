"""`dgemma run sudoku`: the bundled Sudoku model's front end, a renderer of what the server's task layer sends.

The model (recipes/sudoku/) is a task model: its GGUF names the task (`diffusion.task = "sudoku"`, which `/api/show`
lists in `model_info`), and the server runs every request to it as that task (dgemma_cli/server/tasks.py): the rule
checker, self-correction, and up to `task_tries` tries under random symmetries of the puzzle, side by side on the
model's `num_parallel` slots. So `run` sends one request per puzzle and shows what comes back:

- a puzzle as arguments or on stdin: parsed here first (digits, `0` or `.` for blanks, whitespace ignored; one-line
  errors), then stdout not a terminal: exactly 9 lines of 9 digits, nothing else (a fixed interface; notes go to
  stderr); a terminal: the drawn grid, with `--visual` the grid denoising live (the leading try's draft, the givens
  in bold) and otherwise a spinner that counts steps and tries;
- no puzzle, on a terminal: the REPL (repl.py), each message a puzzle, with its slash commands (`/set verbose`,
  `/show info`, ...);
- `--verbose`: the timing block of the server's final chunk (with its `task tries`) on stderr;
- a grid that still breaks a rule is printed anyway, with a warning on stderr, and `run` exits with UNSOLVED_EXIT.

`solve_with_engine` solves one puzzle on a loaded engine model without a server (bench/sudoku.py, the recipe).
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from dgemma_engine.tasks import SUDOKU, SUDOKU_CELLS, TASK_KEY, answer_grid, is_solution, parse_puzzle

if TYPE_CHECKING:
    from dgemma_cli.client import Client
    from dgemma_cli.session import RunSettings, TaskContext
    from dgemma_cli.wire import Progress

MODEL_GENERAL_NAME = "dgemma-sudoku"  # general.name of the bundled GGUF (bundle.py converts from a folder so named)
UNSOLVED_EXIT = 3  # `run`'s exit status when the printed grid is not a solution (1: an error, 130: interrupted)
REPL_HINT = ("Type a puzzle: 81 cells row by row, digits with 0 or . for blanks (\"\"\" for several lines). "
             "/? for help.")


# ---- grids ----------------------------------------------------------------------------------------------------------

def prompt_text(puzzle: str) -> str:
    """What the model's chat template renders for a user message holding `puzzle` (bench and tests tokenize it)."""
    return "<bos>" + "".join(f"<c{cell}={digit}>" for cell, digit in enumerate(puzzle))


def plain_lines(grid: str) -> str:
    """Exactly 9 lines of 9 digits (the non-TTY output; a fixed interface). A cell the model left without a digit
    prints as 0, the puzzle's own blank mark."""
    digits = grid.replace("?", "0")
    return "\n".join(digits[r * 9:(r + 1) * 9] for r in range(9))


def grid_table(puzzle: str, grid: str, title: str | None = None, changed: Sequence[bool] | None = None) -> Table:
    """A drawn grid: givens bold (red when the model wrote another digit there), filled cells cyan (dim while still
    changing), 3x3 boxes separated."""
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
                wrong = grid[i] in "123456789" and grid[i] != puzzle[i]
                style = "bold red" if wrong else "bold"
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


def starting_grid(puzzle: str) -> str:
    """The first frame of `--visual`, before any step: the givens in place, '.' for the cells still to fill."""
    return puzzle.replace("0", ".")


def progress_counter(progress: Progress) -> str:
    """The counter under a drawn frame: which try (tries run one after another, each from fresh noise) and step."""
    counter = f"step {progress.completed}/{progress.total}"
    return counter if progress.task_try is None else f"try {progress.task_try} · {counter}"


def answer_caption(tries: int | None, solved: bool) -> str:
    """The line under the final grid of a visual run: the frames showed the leading try, which may not be the one
    whose grid is the answer (the lowest-numbered try that passes, else the last)."""
    which = f"try {tries}" if tries else "the last try"
    return f"answer: {which}, " + ("a valid solution" if solved else "still breaks a rule")


class LiveGrid:
    """`--visual`: the draft grid redrawn at each denoising step; cells that changed since the last step are dimmed."""

    def __init__(self, console: Console, puzzle: str):
        from rich.live import Live

        self.puzzle = puzzle
        self.previous = starting_grid(puzzle)
        self.live = Live(self.frame(self.previous, "starting"), console=console, refresh_per_second=20,
                         transient=True)
        self.live.start()

    def frame(self, grid: str, counter: str) -> Group:
        changed = [a != b for a, b in zip(grid, self.previous)]
        return Group(grid_table(self.puzzle, grid, changed=changed), Text(counter, style="cyan"))

    def update(self, grid: str, counter: str) -> None:
        self.live.update(self.frame(grid, counter))
        self.previous = grid

    def stop(self) -> None:
        self.live.stop()


# ---- `dgemma run sudoku` -------------------------------------------------------------------------------------------

def is_sudoku_model(show: dict[str, Any]) -> bool:
    """The model's GGUF names the Sudoku task (`/api/show` lists the key in `model_info`)."""
    return (show.get("model_info") or {}).get(TASK_KEY) == SUDOKU


def run_sudoku(context: TaskContext) -> bool:
    """The task renderer: handles the run when the model is a Sudoku task model, else returns False. Exits with
    UNSOLVED_EXIT when a one-shot puzzle's grid is not a solution."""
    if not is_sudoku_model(context.show):
        return False
    if context.prompt is None:  # a terminal and no puzzle: one puzzle per message
        from dgemma_cli.repl import Repl

        print(REPL_HINT)
        Repl(context.client, context.settings, context.show,
             answer=lambda text: solve_and_show(context.client, context.settings, text)).run()
        return True
    if not solve_and_show(context.client, context.settings, context.prompt):
        import typer

        raise typer.Exit(UNSOLVED_EXIT)
    return True


def solve_and_show(client: Client, settings: RunSettings, text: str, out: TextIO | None = None,
                   err: TextIO | None = None) -> bool:
    """Parse `text` as a puzzle, have the server solve it (one request: the tries are the server's), show the grid;
    True when it is a solution."""
    from dgemma_cli.render import timing_block
    from dgemma_cli import wire
    from dgemma_cli.session import chunk_text
    from dgemma_cli.ui import Spinner, is_tty

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    puzzle = parse_puzzle(text)
    tty = is_tty(out)
    console = Console(file=out) if tty else None
    view = LiveGrid(console, puzzle) if (console is not None and settings.visual) else None
    spinner = Spinner(err, enabled=tty and view is None and settings.progress and is_tty(err))
    request = settings.generate_request(puzzle, progress=view is not None or spinner.enabled, preview=view is not None)
    answer, final = "", None
    chunks = client.generate_stream(request)
    try:
        spinner.start("solving")
        for chunk in chunks:
            progress = wire.progress_of(chunk)
            if chunk.get("done"):
                final = chunk
            elif progress is not None:
                counter = progress_counter(progress)
                spinner.set(f"solving · {counter}")
                if view is not None and progress.preview is not None:
                    view.update(answer_grid(progress.preview), counter)
            else:
                answer += chunk_text(chunk)[0]
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        spinner.stop()
        if view is not None:
            view.stop()
    grid = answer_grid(answer)
    solved = is_solution(puzzle, grid)
    if console is not None:
        print_grid(console, puzzle, grid)
        if view is not None and final is not None:  # the frames were of the leading try; say whose grid this is
            console.print(answer_caption(final.get("task_tries"), solved), style="cyan")
    else:
        out.write(plain_lines(grid) + "\n")
        out.flush()
    if settings.verbose and final is not None:
        err.write(timing_block(final) + "\n")
    if not solved:
        tries = (final or {}).get("task_tries")
        suffix = f" ({tries} tries)" if tries else ""
        err.write(f"warning: the model's grid is not a valid solution{suffix}\n")
    err.flush()
    return solved


# ---- solving through the engine directly (bench/sudoku.py, recipes/sudoku/tune.py, tests) --------------------------

@dataclass(frozen=True)
class Solution:
    grid: str  # 81 chars, '?' where the canvas holds no digit
    steps: int  # denoising steps of the committed canvas
    seconds: float  # prefill + denoising
    candidate_steps: int = 0  # denoising steps summed over every candidate canvas (num_canvases)


def solve_with_engine(model: Any, tokenizer: Any, puzzle: str, params: Any, ctx: Any = None,
                      check: bool = False, cancel: threading.Event | None = None) -> Solution:
    """One generation of one canvas on a loaded `dgemma_engine` model (`params`: a SamplerParams, its num_canvases
    candidates included). `check`: as the server runs a try of the task, with the Sudoku checker choosing among
    candidates and sending cells that break a rule back into denoising; else the plain model (the lowest-entropy
    candidate). `cancel` set: stop at the next step (a canvas not yet committed gives a grid of '?')."""
    from dgemma_engine.generate import CanvasEvent, StepEvent, eos_ids_from_metadata, generate
    from dgemma_engine.model import Context
    from dgemma_engine.tasks import SudokuTask

    prompt = tokenizer.encode(prompt_text(puzzle), special=True)
    own = ctx is None
    ctx = ctx if ctx is not None else Context(model, n_ctx=len(prompt) + SUDOKU_CELLS, threads=None,
                                              max_canvases=params.num_canvases)
    checker = SudokuTask.for_vocabulary(tokenizer.tokens).checker(puzzle) if check else None
    candidate_steps = 0
    try:
        ctx.reset()
        start = time.perf_counter()
        eos_ids = eos_ids_from_metadata(model.metadata)
        committed = None
        for event in generate(ctx, prompt, params, max_new_tokens=SUDOKU_CELLS, eos_ids=eos_ids, checker=checker,
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
        return Solution("?" * SUDOKU_CELLS, 0, seconds, candidate_steps)
    canvas = list(committed.canvas)
    if committed.eos_position is not None:  # as transformers: the EOS ends the answer (pad after it)
        canvas = canvas[:committed.eos_position]
    digits = "".join(_digit_of(tokenizer, t) for t in canvas)
    return Solution(digits.ljust(SUDOKU_CELLS, "?"), committed.steps, seconds, candidate_steps)


def _digit_of(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.tokens[token_id] if 0 <= token_id < len(tokenizer.tokens) else ""
    return text if len(text) == 1 and text in "123456789" else "?"
