"""The bundled Sudoku model's task: puzzle parsing and grid rendering for `dgemma run sudoku PUZZLE`.

The model (recipes/sudoku/) reads the 81 cells through its chat template and writes one 81-token canvas of digits.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dgemma_cli.errors import DgemmaError

MODEL_GENERAL_NAME = "dgemma-sudoku"  # general.name of the bundled GGUF: how `run` recognises the task


def parse_puzzle(text: str) -> str:
    """81 cells: digits 1-9, `0` or `.` for blanks, whitespace ignored -> 81 chars of '0'-'9'."""
    cells = "".join(text.split()).replace(".", "0")
    bad = sorted({ch for ch in cells if ch not in "0123456789"})
    if bad:
        raise DgemmaError(f"invalid sudoku puzzle: unexpected character {bad[0]!r} (use digits, '0' or '.' for blanks)")
    if len(cells) != 81:
        raise DgemmaError(f"invalid sudoku puzzle: expected 81 cells, got {len(cells)}")
    return cells


def answer_grid(text: str) -> str:
    """The model's decoded canvas -> 81 chars; a missing or non-digit cell becomes '?' so it never passes as solved."""
    digits = [ch if ch in "123456789" else "?" for ch in "".join(text.split())[:81]]
    return "".join(digits).ljust(81, "?")


def plain_lines(grid: str) -> str:
    """Exactly 9 lines of 9 characters (the non-TTY output; a fixed interface)."""
    return "\n".join(grid[r * 9:(r + 1) * 9] for r in range(9))


def grid_table(puzzle: str, grid: str, title: str | None = None) -> Table:
    """A drawn grid: givens bold, filled cells in another style, 3x3 boxes separated."""
    table = Table(show_header=False, show_lines=False, box=None, padding=(0, 0), title=title)
    table.add_column(no_wrap=True)
    for r in range(9):
        if r in (3, 6):
            table.add_row(Text("------+-------+------", style="dim"))
        line = Text()
        for c in range(9):
            if c in (3, 6):
                line.append("| ", style="dim")
            given = puzzle[r * 9 + c] != "0"
            line.append(grid[r * 9 + c], style="bold" if given else "cyan")
            line.append(" ")
        table.add_row(line)
    return table


def print_grid(console: Console, puzzle: str, grid: str) -> None:
    console.print(grid_table(puzzle, grid))
