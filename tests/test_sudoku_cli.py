"""`dgemma run sudoku [PUZZLE]` as a subprocess on a clean install: an empty store, no server running, and no registry
reachable (the bundled model must register itself from the package, never pull): the printed grid, the exit status,
the `--verbose` timing block, and the REPL that takes puzzles line by line (in a pseudo-terminal)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma_cli import sudoku
from dgemma_cli.store import Store
from dgemma_engine.tasks import is_solution

REPO = Path(__file__).resolve().parent.parent
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DGEMMA_", "OLLAMA_"))}
    dead = f"127.0.0.1:{unused_port()}"  # nothing listens: any pull attempt fails at once
    env.update(DGEMMA_HOST=f"127.0.0.1:{unused_port()}", DGEMMA_MODELS=str(tmp_path / "models"),
               HOME=str(tmp_path / "home"), DGEMMA_REGISTRY_MIRRORS=f"registry.ollama.ai=http://{dead}",
               DGEMMA_NOHISTORY="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def run(args: list[str], env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=180, check=False)


def assert_nine_lines(stdout: str) -> str:
    lines = stdout.split("\n")
    assert lines[-1] == "" and len(lines) == 10, repr(stdout)
    assert all(len(line) == 9 and line.isdigit() for line in lines[:9]), repr(stdout)
    return "".join(lines[:9])


def test_first_run_registers_sudoku_offline_and_prints_nine_lines(clean_env):
    result = run(["run", "sudoku", PUZZLE, "--seed", "1"], clean_env)
    grid = assert_nine_lines(result.stdout)
    solved = is_solution(PUZZLE, grid)
    assert result.returncode == (0 if solved else sudoku.UNSOLVED_EXIT), result.stderr
    # the warning on stderr appears exactly when the printed grid is not a solution
    assert ("not a valid solution" in result.stderr) == (not solved), result.stderr
    store = Store(clean_env["DGEMMA_MODELS"])
    assert [m.name for m in store.list_models()] == ["sudoku:latest"]
    assert store.resolve("sudoku").gguf_path.read_bytes() == (REPO / "modelfiles" / "sudoku.gguf").read_bytes()


def test_puzzle_from_stdin_with_dots_and_whitespace(clean_env):
    grid_text = "\n".join(" ".join(PUZZLE[r * 9:(r + 1) * 9]).replace("0", ".") for r in range(9)) + "\n"
    result = run(["run", "sudoku", "--seed", "1"], clean_env, stdin=grid_text)
    assert result.returncode == 0, result.stderr
    seeded = run(["run", "sudoku", PUZZLE, "--seed", "1"], clean_env)
    assert assert_nine_lines(result.stdout) == assert_nine_lines(seeded.stdout)  # same puzzle, same seed


@pytest.mark.parametrize("args, stdin, message", [
    (["run", "sudoku", PUZZLE[:80]], "", "invalid sudoku puzzle: expected 81 cells, got 80"),
    (["run", "sudoku", PUZZLE[:80] + "x"], "", "invalid sudoku puzzle: unexpected character 'x'"),
    (["run", "sudoku"], "", "invalid sudoku puzzle: expected 81 cells, got 0"),
    (["run", "sudoku", "55" + PUZZLE[2:]], "", "invalid sudoku puzzle: digit 5 appears twice in row 1"),
])
def test_malformed_puzzle_is_one_line_error(clean_env, args, stdin, message):
    result = run(args, clean_env, stdin=stdin)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: {message}") and result.stderr.count("\n") == 1, result.stderr


def readme_puzzles() -> list[str]:
    """The puzzles the README shows (the quickstart's and the classic 30-clue one)."""
    found = re.findall(r"dgemma run sudoku (?:--visual --seed \d+ )?([0-9]{81})", (REPO / "README.md").read_text())
    assert PUZZLE in found and len(found) >= 2, found
    return sorted(set(found))


@pytest.mark.parametrize("puzzle", readme_puzzles())
def test_the_readme_puzzles_are_solved_and_verbose_prints_the_timing_block(clean_env, puzzle):
    result = run(["run", "sudoku", puzzle, "--seed", "1", "--verbose"], clean_env)
    assert result.returncode == 0, result.stderr
    assert is_solution(puzzle, assert_nine_lines(result.stdout)), result.stderr
    labels = [line.split(":")[0] for line in result.stderr.splitlines() if ":" in line]
    for label in ("total duration", "eval count", "denoise steps", "canvases", "steps per canvas", "denoise rate",
                  "task tries"):
        assert label in labels, result.stderr


HARD = "000000010400000000020000000000050407008000300001090000300400200050100000000806000"


def test_an_unsolved_grid_is_printed_with_a_warning_and_a_distinct_exit_status(clean_env):
    result = run(["run", "sudoku", HARD, "--steps", "1", "--seed", "1"], clean_env)  # one step per try: no solution
    assert not is_solution(HARD, assert_nine_lines(result.stdout))
    assert result.returncode == sudoku.UNSOLVED_EXIT == 3
    assert result.stderr.strip() == "warning: the model's grid is not a valid solution (48 tries)", result.stderr


def test_without_a_puzzle_a_terminal_gets_a_repl_that_takes_puzzles_line_by_line(clean_env):
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "run", "sudoku", "--seed", "1"],
                          env={**clean_env, "TERM": "xterm"}, cwd=str(REPO), encoding="utf-8", timeout=120,
                          dimensions=(40, 120))
    try:
        child.expect_exact(sudoku.REPL_HINT[:30])
        child.expect_exact(">>> ")
        child.sendline(PUZZLE)
        child.expect_exact("------+-------+------")  # the drawn grid
        child.expect_exact(">>> ")
        child.sendline("/set verbose")
        child.expect_exact("Set 'verbose' mode.")
        child.expect_exact(">>> ")
        child.sendline(PUZZLE[:80])
        child.expect_exact("Error: invalid sudoku puzzle: expected 81 cells, got 80")
        child.expect_exact(">>> ")
        child.sendline(PUZZLE.replace("0", "."))
        child.expect_exact("task tries:")
        child.expect_exact(">>> ")
        child.sendline("/show info")
        child.expect_exact("task tries")  # the Diffusion block lists the Modelfile's task_tries
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
