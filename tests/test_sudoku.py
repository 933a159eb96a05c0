"""The bundled Sudoku model: puzzle parsing and checking, the shipped GGUF/Modelfile/checkpoint agreeing with the
recipe, and first-use registration into an empty store (no network)."""
from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from dgemma_cli import sudoku
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
    assert sudoku.is_solution(PUZZLE, SOLUTION)
    assert puzzles.is_valid_solution(PUZZLE, SOLUTION)


def test_parse_accepts_dots_and_whitespace():
    spaced = "\n".join(" ".join(PUZZLE[r * 9:(r + 1) * 9].replace("0", ".")) for r in range(9))
    assert sudoku.parse_puzzle(spaced) == PUZZLE
    assert sudoku.parse_puzzle("\t" + PUZZLE + "\n") == PUZZLE


@pytest.mark.parametrize("text, message", [
    (PUZZLE[:-1], "expected 81 cells, got 80"),
    (PUZZLE + "1", "expected 81 cells, got 82"),
    ("", "expected 81 cells, got 0"),
    (PUZZLE[:40] + "x" + PUZZLE[41:], "unexpected character 'x'"),
    (PUZZLE[:40] + "-" + PUZZLE[41:], "unexpected character '-'"),
    ("55" + PUZZLE[2:], "digit 5 appears twice in row 1"),
    (PUZZLE[:27] + "5" + PUZZLE[28:], "digit 5 appears twice in column 1"),
    (PUZZLE[:20] + "5" + PUZZLE[21:], "digit 5 appears twice in box 1"),
])
def test_parse_rejects_malformed_puzzles(text, message):
    with pytest.raises(DgemmaError, match="invalid sudoku puzzle: " + message):
        sudoku.parse_puzzle(text)


def test_is_solution_rejects_broken_grids():
    swapped = SOLUTION[1] + SOLUTION[0] + SOLUTION[2:]  # a row still has 9 digits, but the columns break
    assert not sudoku.is_solution(PUZZLE, swapped)
    changed_given = "6" + SOLUTION[1:]
    assert not sudoku.is_solution(PUZZLE, changed_given)
    assert not sudoku.is_solution(PUZZLE, SOLUTION[:-1] + "?")
    for level in ("easy", "hard"):  # the package's checker agrees with the recipe's on generated puzzles
        for puzzle, solution in puzzles.puzzle_set(level, 2, seed=99):
            assert sudoku.is_solution(puzzle, solution) and puzzles.is_valid_solution(puzzle, solution)
            assert not sudoku.is_solution(puzzle, solution[::-1]) or solution == solution[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_symmetry_maps_a_puzzle_and_its_solution_together_and_back(seed):
    symmetry = sudoku.Symmetry.random(__import__("random").Random(seed))
    moved_puzzle, moved_solution = symmetry.apply(PUZZLE), symmetry.apply(SOLUTION)
    assert moved_puzzle != PUZZLE and moved_solution != SOLUTION
    assert sudoku.is_solution(moved_puzzle, moved_solution)  # a puzzle of its own, with the mapped solution
    assert puzzles.solve_count([int(c) for c in moved_puzzle]) == 1
    assert moved_puzzle.count("0") == PUZZLE.count("0")
    assert symmetry.undo(moved_solution) == SOLUTION and symmetry.undo(moved_puzzle) == PUZZLE
    partial = moved_solution[:40] + "?" + moved_solution[41:]  # a cell without a digit stays one
    assert symmetry.undo(partial).count("?") == 1 and not sudoku.is_solution(PUZZLE, symmetry.undo(partial))


def test_attempts_show_the_puzzle_first_then_new_symmetries_repeatably():
    attempts = sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=7)
    assert len(attempts) == sudoku.MAX_TRIES
    assert attempts[0] == sudoku.Symmetry.identity() and attempts[0].apply(PUZZLE) == PUZZLE
    assert len({a.apply(PUZZLE) for a in attempts}) == sudoku.MAX_TRIES
    assert attempts == sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=7)
    assert attempts[1:] != sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=8)[1:]


class ScriptedClient:
    """Stands in for the server: answers each request with the next grid of `answers(prompt)`, recording prompts."""

    def __init__(self, answers):
        self.answers, self.prompts = answers, []

    def generate_stream(self, body):
        self.prompts.append(body["prompt"])
        yield {"response": self.answers(body["prompt"], len(self.prompts))}
        yield {"done": True, "denoise_steps": 5}


def run_task(client, capsys, seed=3):
    from dgemma_cli.session import RunSettings, TaskContext

    show = {"model_info": {"diffusion.canvas_length": 81}, "template": MODELFILE.read_text()}
    settings = RunSettings(model="sudoku", options={"seed": seed}, verbose=True)
    assert sudoku.run_sudoku(TaskContext(client, show, PUZZLE, settings))
    return capsys.readouterr()


def test_run_retries_under_new_symmetries_and_maps_the_answer_back(capsys):
    shown = {s.apply(PUZZLE): s.apply(SOLUTION) for s in sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=3)}

    def answers(prompt, attempt):  # wrong twice, then the solution of the puzzle as it was shown
        return shown[prompt][::-1] if attempt < 3 else shown[prompt]

    client = ScriptedClient(answers)
    out = run_task(client, capsys)
    assert out.out.replace("\n", "") == SOLUTION
    assert "tries: 3" in out.err and "not a valid solution" not in out.err
    symmetries = sudoku.attempt_symmetries(3, seed=3)
    assert client.prompts == [s.apply(PUZZLE) for s in symmetries] and client.prompts[0] == PUZZLE


def test_run_gives_up_after_max_tries_with_a_warning(capsys):
    client = ScriptedClient(lambda prompt, attempt: "1" * 81)
    out = run_task(client, capsys)
    assert len(client.prompts) == sudoku.MAX_TRIES
    last = sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=3)[-1].undo("1" * 81)  # the last answer, mapped back
    assert out.out == sudoku.plain_lines(last) + "\n" and len(set(last)) == 1
    assert f"not a valid solution ({sudoku.MAX_TRIES} tries)" in out.err


def test_run_with_two_slots_tries_side_by_side_and_commits_the_sequential_answer(capsys):
    """The model's num_parallel (as /api/show lists it) sets how many tries run at once; the answer is still the
    first try that solves, and no try after it is started."""
    symmetries = sudoku.attempt_symmetries(sudoku.MAX_TRIES, seed=3)
    index_of = {s.apply(PUZZLE): i for i, s in enumerate(symmetries)}
    running, most = set(), [0]
    lock = threading.Lock()

    class SlowClient(ScriptedClient):
        def generate_stream(self, body):
            index = index_of[body["prompt"]]
            with lock:
                running.add(index)
                most[0] = max(most[0], len(running))
            time.sleep(0.02 if index % 2 == 0 else 0.1)  # worker 1 is on try 2 while worker 2 is still on try 1
            with lock:
                self.prompts.append(body["prompt"])
                running.discard(index)
            answer = symmetries[index].apply(SOLUTION)  # tries 3 and 5 (index 2 and 4) solve
            yield {"response": answer if index in (2, 4) else answer[::-1]}
            yield {"done": True, "denoise_steps": 5}

    from dgemma_cli.session import RunSettings, TaskContext

    client = SlowClient(None)
    show = {"model_info": {"diffusion.canvas_length": 81}, "template": MODELFILE.read_text(),
            "parameters": 'num_parallel                   2\nnum_predict                    81'}
    settings = RunSettings(model="sudoku", options={"seed": 3}, verbose=True)
    assert sudoku.run_sudoku(TaskContext(client, show, PUZZLE, settings))
    out = capsys.readouterr()
    assert out.out.replace("\n", "") == SOLUTION and "tries: 3" in out.err and "denoising steps: 15" in out.err
    assert most[0] == 2 and sorted(index_of[p] for p in client.prompts) == [0, 1, 2]


def test_generation_slots_reads_num_parallel_from_show():
    assert sudoku.generation_slots({}) == 1
    assert sudoku.generation_slots({"parameters": "num_predict                    81"}) == 1
    listed = "num_ctx                        8\nnum_parallel                   3"
    assert sudoku.generation_slots({"parameters": listed}) == 3


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("solving", [(), (0,), (1,), (4, 6), (2, 3), (7,)])
def test_first_solution_commits_what_a_sequential_run_would(workers, solving):
    started = []
    lock = threading.Lock()

    def attempt(a):
        with lock:
            started.append(a.index)
        time.sleep(0.002 * ((a.index * 7) % 3))  # uneven durations: tries finish out of order
        return a.index

    outcome = sudoku.first_solution(attempt, 8, workers, solved=lambda index: index in solving)
    first = min(solving) if solving else 7
    assert outcome.results == list(range(first + 1)) and outcome.committed == first
    assert sorted(started) == list(range(outcome.started)) and outcome.started >= first + 1


def test_first_solution_cancels_a_later_try_once_an_earlier_one_solves():
    later_started, seen = threading.Event(), {}

    def attempt(a):
        if a.index == 0:
            assert later_started.wait(5)
            return "solved"
        later_started.set()
        seen[a.index] = (a.cancel.wait(5), a.leading())
        return "late"

    outcome = sudoku.first_solution(attempt, 4, 2, solved=lambda r: r == "solved")
    assert outcome.results == ["solved"] and outcome.started == 2 and seen == {1: (True, True)}


def test_first_solution_raises_what_a_try_raised():
    def attempt(a):
        if a.index == 1:
            raise DgemmaError("server went away")
        time.sleep(0.01)
        return False

    with pytest.raises(DgemmaError, match="server went away"):
        sudoku.first_solution(attempt, 6, 2, solved=bool)


def test_answer_grid_and_plain_lines():
    assert sudoku.answer_grid(SOLUTION) == SOLUTION
    assert sudoku.answer_grid(SOLUTION[:80]) == SOLUTION[:80] + "?"
    assert sudoku.answer_grid("<pad>" + SOLUTION)[:5] == "?????"
    lines = sudoku.plain_lines(sudoku.answer_grid(SOLUTION[:79])).split("\n")
    assert len(lines) == 9 and all(len(line) == 9 and line.isdigit() for line in lines)
    assert lines[-1].endswith("00")  # cells without a digit print as the blank mark


# ---- the shipped artefacts agree with the recipe ------------------------------------------------------------------

def test_modelfile_template_is_the_recipes_chat_template():
    mf = parse_modelfile(MODELFILE.read_bytes())
    assert MODELFILE.read_text().startswith("# ")
    assert mf.from_ == "./sudoku.gguf"
    assert mf.template == vocab.CHAT_TEMPLATE
    assert mf.parameters == {"num_predict": 81, "num_canvases": 1, "diffusion_steps": 12, "num_parallel": 2,
                             "num_thread": 1}


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
    from dgemma_engine.chat import render_chat
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
    assert local.parameters == {"num_predict": 81, "num_canvases": 1, "diffusion_steps": 12, "num_parallel": 2,
                                "num_thread": 1}
    assert local.config["model_family"] == "diffusion-gemma" and local.config["template_format"] == "jinja"
    manifest = store.read_manifest("sudoku").raw
    assert register_bundled(store, ModelName.parse("sudoku"))  # already there: left alone
    assert store.read_manifest("sudoku").raw == manifest
    assert [e.name for e in store.list_models()] == ["sudoku:latest"]
