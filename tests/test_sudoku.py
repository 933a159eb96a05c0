"""The bundled Sudoku model: puzzle parsing and checking, symmetries, the shipped GGUF/Modelfile/checkpoint agreeing
with the recipe (the GGUF's task marker included), and first-use registration into an empty store (no network). The
server's tries are tests/test_sudoku_task.py."""
from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from pathlib import Path

import pytest

from dgemma_cli import sudoku
from dgemma_engine import tasks
from dgemma_cli.bundled import bundled_modelfile, register_bundled
from dgemma_cli.errors import DgemmaError
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.names import ModelName
from dgemma_cli.store import Store

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "sudoku"
GGUF = REPO / "modelfiles" / "sudoku.gguf"
MODELFILE = REPO / "modelfiles" / "sudoku.Modelfile"
CHECKPOINT = RECIPE / "checkpoint"
sys.path.insert(0, str(RECIPE))
import puzzles
import vocab

# A known puzzle and its unique solution (checked below with the recipe's own solver).
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


# ---- puzzles and grids ---------------------------------------------------------------------------------------------

def test_known_puzzle_is_unique_and_solved_by_solution():
    assert puzzles.solve_count([int(c) for c in PUZZLE]) == 1
    assert tasks.is_solution(PUZZLE, SOLUTION)
    assert puzzles.is_valid_solution(PUZZLE, SOLUTION)


def test_parse_accepts_dots_and_whitespace():
    spaced = "\n".join(" ".join(PUZZLE[r * 9:(r + 1) * 9].replace("0", ".")) for r in range(9))
    assert tasks.parse_puzzle(spaced) == PUZZLE
    assert tasks.parse_puzzle("\t" + PUZZLE + "\n") == PUZZLE


@pytest.mark.parametrize("text, message", [
    (PUZZLE[:-1], "expected 81 cells, got 80"),
    (PUZZLE + "1", "expected 81 cells, got 82"),
    ("", "expected 81 cells, got 0"),
    (PUZZLE[:40] + "x" + PUZZLE[41:], "unexpected character 'x'"),
    (PUZZLE[:40] + "-" + PUZZLE[41:], "unexpected character '-'"),
    ("hello world", "unexpected character 'h'"),  # the first character typed, not the first in sort order
    ("55" + PUZZLE[2:], "digit 5 appears twice in row 1"),
    (PUZZLE[:27] + "5" + PUZZLE[28:], "digit 5 appears twice in column 1"),
    (PUZZLE[:20] + "5" + PUZZLE[21:], "digit 5 appears twice in box 1"),
])
def test_parse_rejects_malformed_puzzles(text, message):
    with pytest.raises(DgemmaError, match="invalid sudoku puzzle: " + message):
        tasks.parse_puzzle(text)


def test_is_solution_rejects_broken_grids():
    swapped = SOLUTION[1] + SOLUTION[0] + SOLUTION[2:]  # a row still has 9 digits, but the columns break
    assert not tasks.is_solution(PUZZLE, swapped)
    changed_given = "6" + SOLUTION[1:]
    assert not tasks.is_solution(PUZZLE, changed_given)
    assert not tasks.is_solution(PUZZLE, SOLUTION[:-1] + "?")
    for level in ("easy", "hard"):  # the package's checker agrees with the recipe's on generated puzzles
        for puzzle, solution in puzzles.puzzle_set(level, 2, seed=99):
            assert tasks.is_solution(puzzle, solution) and puzzles.is_valid_solution(puzzle, solution)
            assert not tasks.is_solution(puzzle, solution[::-1]) or solution == solution[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_symmetry_maps_a_puzzle_and_its_solution_together_and_back(seed):
    symmetry = tasks.Symmetry.random(__import__("random").Random(seed))
    moved_puzzle, moved_solution = symmetry.apply(PUZZLE), symmetry.apply(SOLUTION)
    assert moved_puzzle != PUZZLE and moved_solution != SOLUTION
    assert tasks.is_solution(moved_puzzle, moved_solution)  # a puzzle of its own, with the mapped solution
    assert puzzles.solve_count([int(c) for c in moved_puzzle]) == 1
    assert moved_puzzle.count("0") == PUZZLE.count("0")
    assert symmetry.undo(moved_solution) == SOLUTION and symmetry.undo(moved_puzzle) == PUZZLE
    partial = moved_solution[:40] + "?" + moved_solution[41:]  # a cell without a digit stays one
    assert symmetry.undo(partial).count("?") == 1 and not tasks.is_solution(PUZZLE, symmetry.undo(partial))


def test_attempts_show_the_puzzle_first_then_new_symmetries_repeatably():
    attempts = tasks.attempt_symmetries(24, seed=7)
    assert len(attempts) == 24
    assert attempts[0] == tasks.Symmetry.identity() and attempts[0].apply(PUZZLE) == PUZZLE
    assert len({a.apply(PUZZLE) for a in attempts}) == 24
    assert attempts == tasks.attempt_symmetries(24, seed=7)
    assert attempts[1:] != tasks.attempt_symmetries(24, seed=8)[1:]


def test_answer_grid_and_plain_lines():
    assert tasks.answer_grid(SOLUTION) == SOLUTION
    assert tasks.answer_grid(SOLUTION[:80]) == SOLUTION[:80] + "?"
    assert tasks.answer_grid("<pad>" + SOLUTION)[:5] == "?????"
    lines = sudoku.plain_lines(tasks.answer_grid(SOLUTION[:79])).split("\n")
    assert len(lines) == 9 and all(len(line) == 9 and line.isdigit() for line in lines)
    assert lines[-1].endswith("00")  # cells without a digit print as the blank mark


# ---- the shipped artefacts agree with the recipe ------------------------------------------------------------------

def test_modelfile_template_is_the_recipes_chat_template():
    mf = parse_modelfile(MODELFILE.read_bytes())
    assert MODELFILE.read_text().startswith("# ")
    assert mf.from_ == "./sudoku.gguf"
    assert mf.template == vocab.CHAT_TEMPLATE
    assert mf.parameters == {"num_predict": 81, "num_canvases": 1, "diffusion_steps": 12, "task_tries": 48,
                             "num_parallel": 2, "num_thread": 1}


def test_prompt_text_is_what_the_template_renders_and_tokenizes_like_the_recipe():
    from dgemma_engine.model import Model
    from dgemma_engine.tokenizer import Tokenizer
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    rendered = ImmutableSandboxedEnvironment().from_string(vocab.CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": PUZZLE}], bos_token="<bos>")
    assert rendered == sudoku.prompt_text(PUZZLE)
    with Model.load(str(GGUF), threads=1) as model:
        assert model.metadata["tokenizer.chat_template"] == vocab.CHAT_TEMPLATE
        tok = Tokenizer.from_metadata(model.metadata)
        assert tok.encode(rendered, special=True) == vocab.prompt_ids(PUZZLE)
        assert "".join(tok.decode([i]) for i in vocab.answer_ids(SOLUTION)) == SOLUTION


def test_template_answers_the_latest_user_message_only_and_ignores_tools():
    """Modelfile, checkpoint and GGUF carry one template; a second turn (or Open WebUI's tools) must not break the
    grid: only the latest user message renders."""
    from dgemma_engine.chat.jinja import render_chat
    from dgemma_engine.model import Model

    assert (CHECKPOINT / "chat_template.jinja").read_text() == vocab.CHAT_TEMPLATE
    assert parse_modelfile(MODELFILE.read_bytes()).template == vocab.CHAT_TEMPLATE
    with Model.load(str(GGUF), threads=1) as model:
        assert model.metadata["tokenizer.chat_template"] == vocab.CHAT_TEMPLATE
    chat = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": SOLUTION},
            {"role": "assistant", "content": SOLUTION}, {"role": "user", "content": PUZZLE}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert render_chat(vocab.CHAT_TEMPLATE, chat, bos_token="<bos>", tools=tools) == sudoku.prompt_text(PUZZLE)


def test_shipped_gguf_is_the_bundled_checkpoint():
    from dgemma_engine.model import Model

    bundle = json.loads((CHECKPOINT / "bundle.json").read_text())
    assert hashlib.sha256(GGUF.read_bytes()).hexdigest() == bundle["gguf_sha256"], "re-run recipes/sudoku/bundle.py"
    assert hashlib.sha256((CHECKPOINT / "model.safetensors").read_bytes()).hexdigest() == bundle["checkpoint_sha256"]
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert GGUF.stat().st_size < 8 << 20  # "a few MB"
    with Model.load(str(GGUF), threads=1) as model:
        assert model.metadata["general.name"] == sudoku.MODEL_GENERAL_NAME
        assert tasks.task_name(model.metadata) == tasks.SUDOKU  # the marker that makes the server run the task
        assert model.metadata["general.file_type"] == 0  # ALL_F32: the f16-exact checkpoint weights, computed in f32
        assert model.hparams.canvas_length == 81
        # every embedding row kept: dgemma draws random canvas tokens over the same ids as transformers
        assert model.hparams.n_vocab == config["text_config"]["vocab_size"] == vocab.VOCAB_SIZE + 3


def test_gguf_ships_as_package_data():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = pyproject["tool"]["setuptools"]
    assert tool["package-dir"]["dgemma_modelfiles"] == "modelfiles"
    assert "*.gguf" in tool["package-data"]["dgemma_modelfiles"]
    assert "*.Modelfile" in tool["package-data"]["dgemma_modelfiles"]


# ---- first-use registration -----------------------------------------------------------------------------------------

def test_only_the_default_sudoku_name_is_bundled():
    assert bundled_modelfile(ModelName.parse("sudoku")) == MODELFILE.resolve()
    assert bundled_modelfile(ModelName.parse("Sudoku:latest")) == MODELFILE.resolve()
    for other in ("sudoku:7b", "someone/sudoku", "example.com/library/sudoku", "fast", "tiny"):
        assert bundled_modelfile(ModelName.parse(other)) is None, other


def test_register_bundled_into_an_empty_store(tmp_path):
    store = Store(tmp_path / "models")
    assert not register_bundled(store, ModelName.parse("tiny"))
    assert not (tmp_path / "models").exists()  # nothing written for other names
    assert register_bundled(store, ModelName.parse("sudoku"))
    local = store.resolve("sudoku")
    assert local.gguf_path.read_bytes() == GGUF.read_bytes()
    assert local.template == vocab.CHAT_TEMPLATE
    assert local.parameters == {"num_predict": 81, "num_canvases": 1, "diffusion_steps": 12, "task_tries": 48,
                                "num_parallel": 2, "num_thread": 1}
    assert local.config["model_family"] == "diffusion-gemma" and local.config["template_format"] == "jinja"
    manifest = store.read_manifest("sudoku").raw
    assert register_bundled(store, ModelName.parse("sudoku"))  # already there: left alone
    assert store.read_manifest("sudoku").raw == manifest
    assert [e.name for e in store.list_models()] == ["sudoku:latest"]
