"""Sudoku grids and puzzles: solved-grid generation, unique-solution puzzles by difficulty, validity checks.

Pure Python and seeded (random.Random), so data sets are reproducible. Grids are 81-character strings, row-major,
'0' for a blank cell.
"""
from __future__ import annotations

import random

DIFFICULTY_CLUES = {"easy": (36, 45), "medium": (30, 35), "hard": (24, 29)}

ROWS = [[r * 9 + c for c in range(9)] for r in range(9)]
COLS = [[r * 9 + c for r in range(9)] for c in range(9)]
BOXES = [[(br * 3 + r) * 9 + bc * 3 + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
UNITS = ROWS + COLS + BOXES
PEERS = [sorted({p for unit in UNITS if i in unit for p in unit} - {i}) for i in range(81)]


def solve_count(cells: list[int], limit: int = 2) -> int:
    """Number of solutions of `cells` (0 = blank), counting up to `limit`. Most-constrained-cell backtracking."""
    cells = list(cells)
    count = 0

    def candidates(i: int) -> set[int]:
        return set(range(1, 10)) - {cells[p] for p in PEERS[i]}

    def search() -> bool:
        nonlocal count
        best, best_cands = -1, None
        for i in range(81):
            if cells[i] == 0:
                cands = candidates(i)
                if best_cands is None or len(cands) < len(best_cands):
                    best, best_cands = i, cands
                    if len(cands) <= 1:
                        break
        if best < 0:
            count += 1
            return count >= limit
        for d in best_cands:
            cells[best] = d
            if search():
                return True
        cells[best] = 0
        return False

    search()
    return count


def random_solution(rng: random.Random) -> list[int]:
    """A uniformly shuffled valid solved grid (random fill by backtracking with shuffled candidates)."""
    cells = [0] * 81

    def fill(i: int) -> bool:
        if i == 81:
            return True
        digits = list(range(1, 10))
        rng.shuffle(digits)
        used = {cells[p] for p in PEERS[i]}
        for d in digits:
            if d not in used:
                cells[i] = d
                if fill(i + 1):
                    return True
        cells[i] = 0
        return False

    fill(0)
    return cells


def make_puzzle(rng: random.Random, n_clues: int) -> tuple[str, str]:
    """A puzzle with exactly `n_clues` givens and a unique solution: returns (puzzle, solution)."""
    while True:
        solution = random_solution(rng)
        cells = list(solution)
        order = list(range(81))
        rng.shuffle(order)
        filled = 81
        for i in order:
            if filled == n_clues:
                break
            saved, cells[i] = cells[i], 0
            if solve_count(cells) != 1:
                cells[i] = saved
            else:
                filled -= 1
        if filled == n_clues:
            return to_text(cells), to_text(solution)


def training_example(rng: random.Random, n_clues: int) -> tuple[str, str]:
    """A training pair: random solution with `n_clues` random givens (uniqueness not enforced: cheap, and rare)."""
    solution = random_solution(rng)
    keep = set(rng.sample(range(81), n_clues))
    cells = [d if i in keep else 0 for i, d in enumerate(solution)]
    return to_text(cells), to_text(solution)


def to_text(cells: list[int]) -> str:
    return "".join(str(d) for d in cells)


def is_valid_solution(puzzle: str, grid: str) -> bool:
    """True when `grid` is a complete valid Sudoku that keeps every given of `puzzle`."""
    if len(grid) != 81 or not grid.isdigit() or "0" in grid:
        return False
    if any(p != "0" and p != g for p, g in zip(puzzle, grid)):
        return False
    return all(len({grid[i] for i in unit}) == 9 for unit in UNITS)


def puzzle_set(difficulty: str, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` unique-solution puzzles of one difficulty, reproducible from `seed`."""
    lo, hi = DIFFICULTY_CLUES[difficulty]
    rng = random.Random(f"{difficulty}-{seed}")
    return [make_puzzle(rng, rng.randint(lo, hi)) for _ in range(count)]


def random_symmetry(grid: list[int], rng: random.Random) -> list[int]:
    """Apply a random validity-preserving transform: digit relabelling, band/stack and row/column shuffles, transpose."""
    relabel = [0] + rng.sample(range(1, 10), 9)
    bands, stacks = rng.sample(range(3), 3), rng.sample(range(3), 3)
    rows = [b * 3 + r for b in bands for r in rng.sample(range(3), 3)]
    cols = [s * 3 + c for s in stacks for c in rng.sample(range(3), 3)]
    transpose = rng.random() < 0.5
    out = []
    for r in range(9):
        for c in range(9):
            src = cols[c] * 9 + rows[r] if transpose else rows[r] * 9 + cols[c]
            out.append(relabel[grid[src]])
    return out
