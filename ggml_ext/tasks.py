"""Task models: models trained on one task whose answers can be checked, named by the GGUF key `diffusion.task`.

A task model's GGUF says which task it was trained on (TASK_KEY, written by its recipe, e.g. recipes/sudoku/bundle.py).
The server runs every request to such a model as the task (dgemma_cli/server/tasks.py): it reads the task's input from
the prompt, hands the generation loop the task's checker (to choose among candidate canvases and to renoise positions
that break a rule: self-correction), and tries again under a new symmetry of the input, up to `task_tries` times, until
an answer passes. A model without the key is a text model: nothing here runs for it.

The one task today is `sudoku`, the bundled model (recipes/sudoku/): its prompt ends in one `<c{cell}={digit}>` token
per cell (digit 0 = blank) and its answer is one 81-position canvas of the digits 1-9. This module holds its rules,
puzzles, grids and symmetries; pure Python, so the server, the CLI and the bench share them without the native engine.
"""
from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dgemma_engine.errors import DgemmaError
from dgemma_engine import gguf_keys

TASK_KEY = "diffusion.task"  # GGUF string: the task the model was trained on (absent: a text model)
SUDOKU = "sudoku"

SUDOKU_CELLS = 81
ROWS = [[r * 9 + c for c in range(9)] for r in range(9)]
COLS = [[r * 9 + c for r in range(9)] for c in range(9)]
BOXES = [[(br * 3 + r) * 9 + bc * 3 + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
UNITS = [("row", i + 1, u) for i, u in enumerate(ROWS)] + [("column", i + 1, u) for i, u in enumerate(COLS)] + \
    [("box", i + 1, u) for i, u in enumerate(BOXES)]
_CELL_TOKEN = re.compile(r"<c(\d+)=(\d)>")


class CanvasChecker(Protocol):
    def violations(self, canvas: Sequence[int]) -> list[int]:
        """Positions of `canvas` (token ids) that break a rule; empty when it passes."""
        ...


def task_name(metadata: Mapping[str, Any]) -> str | None:
    """The task a model's GGUF names (None: a text model)."""
    value = metadata.get(TASK_KEY)
    return str(value) if value else None


# ---- puzzles and grids ----------------------------------------------------------------------------------------------

def parse_puzzle(text: str) -> str:
    """81 cells: digits 1-9, `0` or `.` for blanks, whitespace ignored -> 81 chars of '0'-'9'. Givens that already
    break a rule (the same digit twice in a row, column or box) are rejected too: no grid could solve them."""
    cells = "".join(text.split()).replace(".", "0")
    bad = next((ch for ch in cells if ch not in "0123456789"), None)  # the first one typed, as the user reads it
    if bad is not None:
        raise DgemmaError(f"invalid sudoku puzzle: unexpected character {bad!r} (use digits, '0' or '.' for blanks)")
    if len(cells) != SUDOKU_CELLS:
        raise DgemmaError(f"invalid sudoku puzzle: expected 81 cells, got {len(cells)}")
    check_givens(cells)
    return cells


def check_givens(puzzle: str) -> None:
    """Raise the one-line error for givens of `puzzle` (81 chars '0'-'9') that repeat in a row, column or box."""
    for kind, number, unit in UNITS:
        givens = [puzzle[i] for i in unit if puzzle[i] != "0"]
        repeated = sorted({d for d in givens if givens.count(d) > 1})
        if repeated:
            raise DgemmaError(f"invalid sudoku puzzle: digit {repeated[0]} appears twice in {kind} {number}")


def answer_grid(text: str) -> str:
    """A decoded canvas -> 81 chars; a missing or non-digit cell becomes '?' so it never passes as solved."""
    digits = [ch if ch in "123456789" else "?" for ch in "".join(text.split())[:SUDOKU_CELLS]]
    return "".join(digits).ljust(SUDOKU_CELLS, "?")


def is_solution(puzzle: str, grid: str) -> bool:
    """`grid` fills every cell with 1-9, keeps every given of `puzzle`, and each row, column and box has 9 digits."""
    if len(grid) != SUDOKU_CELLS or any(ch not in "123456789" for ch in grid):
        return False
    if any(p != "0" and p != g for p, g in zip(puzzle, grid)):
        return False
    return all(len({grid[i] for i in unit}) == 9 for _, _, unit in UNITS)


def sudoku_violations(puzzle: str, grid: Sequence[int]) -> list[int]:
    """Cells of `grid` (81 digits, 0 = no digit) that break a rule of `puzzle` (81 chars '0'-'9'): no digit, a given
    not kept, or a digit repeated in a row, column or box (the non-given cells of the repeat)."""
    bad = {i for i in range(SUDOKU_CELLS) if grid[i] == 0 or (puzzle[i] != "0" and int(puzzle[i]) != grid[i])}
    for _, _, unit in UNITS:
        seen: dict[int, list[int]] = {}
        for i in unit:
            if grid[i]:
                seen.setdefault(grid[i], []).append(i)
        for cells in seen.values():
            if len(cells) > 1:
                bad.update(i for i in cells if puzzle[i] == "0")
    return sorted(bad)


@dataclass(frozen=True)
class SudokuChecker:
    puzzle: str               # 81 chars '0'-'9'
    digit_of: dict[int, int]  # token id -> digit 1-9

    def violations(self, canvas: Sequence[int]) -> list[int]:
        return sudoku_violations(self.puzzle, [self.digit_of.get(int(t), 0) for t in canvas[:SUDOKU_CELLS]])


# ---- symmetries -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Symmetry:
    """A transform that maps Sudoku solutions to Sudoku solutions: cell i of the transformed grid is cell `source[i]`
    of the original, its digit d written as `digits[d]` (0, a blank, stays 0; any other mark is kept).

    The model's mistakes on one puzzle repeat under a new seed but mostly not under a new symmetry, which it sees as
    another puzzle; every digit of the mapped-back answer still comes from the model."""
    source: tuple[int, ...]
    digits: tuple[int, ...]

    @classmethod
    def identity(cls) -> Symmetry:
        return cls(tuple(range(SUDOKU_CELLS)), tuple(range(10)))

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
        return "".join(self._digit(ch, inverse) for ch in self.undo_positions(list(grid)))

    def undo_positions(self, items: Sequence[Any]) -> list[Any]:
        """Per-cell values of a transformed grid (a draft's tokens, its accepted flags) back in the original's cells."""
        out: list[Any] = [None] * SUDOKU_CELLS
        for i, s in enumerate(self.source):
            out[s] = items[i]
        return out

    @staticmethod
    def _digit(ch: str, table: Sequence[int]) -> str:
        return str(table[int(ch)]) if ch in "0123456789" else ch


def attempt_symmetries(tries: int, seed: int | None) -> list[Symmetry]:
    """What each of `tries` attempts shows the model: the puzzle itself first, then fresh random symmetries (drawn
    from `seed`, so a seeded request repeats)."""
    rng = random.Random(seed)
    return [Symmetry.identity()] + [Symmetry.random(rng) for _ in range(tries - 1)]


# ---- the task on one model's vocabulary -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SudokuTask:
    """The Sudoku task on a model's vocabulary: the cell tokens its prompts end in, the digit tokens it answers in."""

    cell_token: dict[tuple[int, int], int]  # (cell, digit) -> token id of `<c{cell}={digit}>`
    digit_of: dict[int, int]                # token id -> digit 1-9

    @classmethod
    def for_vocabulary(cls, tokens: Sequence[str]) -> SudokuTask:
        cells = {}
        for token_id, text in enumerate(tokens):
            match = _CELL_TOKEN.fullmatch(text)
            if match is not None and int(match.group(1)) < SUDOKU_CELLS:
                cells[int(match.group(1)), int(match.group(2))] = token_id
        if len(cells) != SUDOKU_CELLS * 10:
            raise DgemmaError(f"the model's GGUF names the task {SUDOKU!r} but its vocabulary lacks the cell tokens")
        digit_of = {i: int(t) for i, t in enumerate(tokens) if len(t) == 1 and t in "123456789"}
        return cls(cells, digit_of)

    def read_prompt(self, prompt_ids: Sequence[int]) -> tuple[list[int], str]:
        """(the prompt before its cells, the puzzle) of a prompt that ends in the 81 cell tokens in order, as the
        model's template writes a message of 81 digits; else the one-line error (a 400 in the server)."""
        cell_of = {token_id: key for key, token_id in self.cell_token.items()}
        tail = [cell_of.get(int(t)) for t in prompt_ids[-SUDOKU_CELLS:]]
        if len(tail) < SUDOKU_CELLS or any(key is None or key[0] != i for i, key in enumerate(tail)):
            raise DgemmaError("invalid sudoku puzzle: the latest message must be the 81 cells of a puzzle, "
                              "row by row (digits 1-9, 0 for a blank)")
        puzzle = "".join(str(digit) for _, digit in tail)
        check_givens(puzzle)
        return [int(t) for t in prompt_ids[:-SUDOKU_CELLS]], puzzle

    def prompt(self, head: Sequence[int], puzzle: str) -> list[int]:
        """`head` followed by the cell tokens of `puzzle` (what the template renders for that message)."""
        return list(head) + [self.cell_token[cell, int(digit)] for cell, digit in enumerate(puzzle)]

    def checker(self, puzzle: str) -> SudokuChecker:
        return SudokuChecker(puzzle, self.digit_of)


def task_for(metadata: Mapping[str, Any]) -> SudokuTask | None:
    """The task of a model by its GGUF metadata, None for a text model; an unknown task name is an error (a newer
    recipe than this dgemma)."""
    name = task_name(metadata)
    if name is None:
        return None
    if name != SUDOKU:
        raise DgemmaError(f"the model's task {name!r} is not one this dgemma knows (known: {SUDOKU})")
    return SudokuTask.for_vocabulary(list(metadata.get(gguf_keys.KEY_TOKENS) or ()))
