"""Task checkers: rules a committed canvas can be checked against, for models trained on one task.

A checker says which canvas positions break the task's rules (an empty list: the canvas passes). The generation
loop uses it to pick among candidate canvases (num_canvases: the first that passes is committed) and, with
self-correction, to send the positions that break a rule back into denoising; every token still comes from the
model. Pure Python: the server and the CLI use the rules without the native engine.

The one task today is the bundled Sudoku model (recipes/sudoku/): a prompt of one `<c{cell}={digit}>` token per cell
(digit 0 = blank) and an 81-position canvas of the digits 1-9.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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
    puzzle: str               # 81 chars '0'-'9' read from the prompt's cell tokens
    digit_of: dict[int, int]  # token id -> digit 1-9

    def violations(self, canvas: Sequence[int]) -> list[int]:
        return sudoku_violations(self.puzzle, [self.digit_of.get(int(t), 0) for t in canvas[:SUDOKU_CELLS]])


def task_checker(tokens: Sequence[str], canvas_length: int, prompt_ids: Sequence[int]) -> CanvasChecker | None:
    """The checker of the task this model and prompt pose, or None: Sudoku when the canvas has 81 positions and the
    prompt's last 81 tokens are the cell tokens `<c0=d>` .. `<c80=d>` in order."""
    if canvas_length != SUDOKU_CELLS or len(prompt_ids) < SUDOKU_CELLS:
        return None
    cells = []
    for expected, token_id in enumerate(prompt_ids[-SUDOKU_CELLS:]):
        match = _CELL_TOKEN.fullmatch(tokens[token_id]) if 0 <= token_id < len(tokens) else None
        if match is None or int(match.group(1)) != expected:
            return None
        cells.append(match.group(2))
    digit_of = {i: int(t) for i, t in enumerate(tokens) if len(t) == 1 and t in "123456789"}
    return SudokuChecker("".join(cells), digit_of)
