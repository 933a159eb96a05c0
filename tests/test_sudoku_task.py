"""The server's task layer (dgemma_cli/server/tasks.py): a model whose GGUF names the Sudoku task is answered with the
checker, tries under symmetries and side-by-side tries for every client, and says "stop" only for a solved grid.

The first half drives `run_task` with a scripted runner (which answers each try as the test decides); the second sends
the README's puzzles to the bundled model through the real `ollama` Python client."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from dgemma_cli.server import answers
from dgemma_cli.server.options import resolve_sampler
from dgemma_cli.server.tasks import TaskRequest, TryPool, first_solution, run_task
from dgemma_cli.wire import Progress
from dgemma_engine import tasks
from dgemma_engine.errors import DgemmaError
from dgemma_engine.events import CanvasEvent, DoneEvent, GenerationStats, StepEvent

REPO = Path(__file__).resolve().parent.parent
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
TOKENS = ["<pad>", "<eos>", "<bos>"] + [str(d) for d in range(10)] + \
    [f"<c{cell}={digit}>" for cell in range(81) for digit in range(10)]


class ScriptedRunner:
    """A Sudoku task model whose answer to each try is `answer(shown_puzzle, try_number)`; records the prompts."""

    canvas_length = 81
    context_length = 256
    metadata = {tasks.TASK_KEY: tasks.SUDOKU, "tokenizer.ggml.tokens": TOKENS}

    def __init__(self, answer, delay=lambda shown: 0.0):
        self.answer, self.delay = answer, delay
        self.task = tasks.SudokuTask.for_vocabulary(TOKENS)
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()
        self.running, self.most_running = 0, 0

    def tokenize(self, text):
        return [TOKENS.index(ch) for ch in text]

    def detokenize(self, ids):
        return "".join(TOKENS[i] for i in ids)

    def generate(self, prompt_ids, sampler, max_new_tokens, cancel, checker=None):
        assert max_new_tokens == 81 and checker is not None
        _, shown = self.task.read_prompt(prompt_ids)
        with self.lock:
            self.prompts.append(list(prompt_ids))
            number = len(self.prompts)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            time.sleep(self.delay(shown))
            grid = self.answer(shown, number)
            ids = self.tokenize(grid)
            yield StepEvent(0, 1, sampler.max_steps, ids, 0.5, 81, [True] * 81)
            yield CanvasEvent(0, ids, grid, 1, ids, checked=not checker.violations(ids))
            yield DoneEvent("length", GenerationStats(len(prompt_ids), 0.001, 1, [1], 81, 0.01, 8100.0))
        finally:
            with self.lock:
                self.running -= 1


def solve(runner, options, workers=1, prompt=PUZZLE):
    """run_task on the prompt the template writes for `prompt`; returns (answer text, Final, progress items)."""
    sampler = resolve_sampler({"num_predict": 81, **options}, runner.metadata, 256)
    prompt_ids = [2] + [runner.task.cell_token[cell, int(d)] for cell, d in enumerate(prompt)]
    request = TaskRequest.read(runner, prompt_ids)
    plan = answers.plan_generation(runner, prompt_ids, sampler, 16)
    items = list(run_task(runner, plan, sampler, threading.Event(), request, workers, time.perf_counter()))
    text = "".join(i.text for i in items if isinstance(i, answers.Text))
    finals = [i for i in items if isinstance(i, answers.Final)]
    assert len(finals) == 1
    return text, finals[0], [i for i in items if isinstance(i, Progress)]


def shown_solution(shown: str) -> str:
    """The solution of a transformed puzzle: the symmetry that made it, applied to SOLUTION."""
    for symmetry in tasks.attempt_symmetries(24, seed=3):
        if symmetry.apply(PUZZLE) == shown:
            return symmetry.apply(SOLUTION)
    raise AssertionError("not a try of PUZZLE under seed 3")


def test_tries_go_on_under_new_symmetries_until_one_solves_and_the_answer_is_mapped_back():
    runner = ScriptedRunner(lambda shown, n: shown_solution(shown)[::-1] if n < 3 else shown_solution(shown))
    text, final, progress = solve(runner, {"seed": 3, "task_tries": 24, "diffusion_progress": True})
    assert text == SOLUTION and final.done_reason == "stop"
    assert final.metrics.task_tries == 3 and final.metrics.canvases == 3 and final.metrics.denoise_steps == 3
    expected = [runner.task.prompt([2], s.apply(PUZZLE)) for s in tasks.attempt_symmetries(3, seed=3)]
    assert runner.prompts == expected and runner.prompts[0][1:] == [runner.task.cell_token[c, int(d)]
                                                                   for c, d in enumerate(PUZZLE)]
    assert [(p.task_try, p.completed, p.preview) for p in progress] == [(1, 1, None), (2, 1, None), (3, 1, None)]


def test_the_preview_of_a_try_is_mapped_back_to_the_puzzle_as_asked():
    runner = ScriptedRunner(lambda shown, n: shown_solution(shown)[::-1] if n < 2 else shown_solution(shown))
    _, _, progress = solve(runner, {"seed": 3, "task_tries": 4, "diffusion_preview": True})
    assert progress[1].task_try == 2 and progress[1].preview == SOLUTION
    assert progress[1].preview_tokens == list(SOLUTION) and progress[1].preview_accepted == [True] * 81


def test_when_every_try_fails_the_last_answer_comes_back_with_done_reason_length():
    runner = ScriptedRunner(lambda shown, n: "1" * 81)
    text, final, _ = solve(runner, {"seed": 3, "task_tries": 5})
    assert len(runner.prompts) == 5 and final.metrics.task_tries == 5
    last = tasks.attempt_symmetries(5, seed=3)[-1].undo("1" * 81)  # the last try's answer, mapped back
    assert text == last and len(set(last)) == 1 and final.done_reason == "length"


def test_a_cell_without_a_digit_comes_back_as_the_blank_mark():
    runner = ScriptedRunner(lambda shown, n: "0" * 81)
    text, final, _ = solve(runner, {"task_tries": 1})
    assert text == "0" * 81 and final.done_reason == "length"


def test_one_try_per_free_slot_and_the_lowest_solving_try_is_the_answer():
    """Two workers: try 2 (index 1) is slow, so tries 3-5 finish first; tries 3 and 5 solve, and try 3 is the answer
    (as a sequential run would give); no try after it is started once it is known."""
    def answer(shown, n):
        index = next(i for i, s in enumerate(tasks.attempt_symmetries(24, seed=3)) if s.apply(PUZZLE) == shown)
        right = shown_solution(shown)
        return right if index in (2, 4) else right[::-1]

    def delay(shown):
        return 0.15 if shown == tasks.attempt_symmetries(24, seed=3)[1].apply(PUZZLE) else 0.01

    runner = ScriptedRunner(answer, delay)
    text, final, _ = solve(runner, {"seed": 3, "task_tries": 24}, workers=2)
    assert text == SOLUTION and final.metrics.task_tries == 3 and runner.most_running == 2
    assert len(runner.prompts) <= 5


def test_a_client_that_leaves_stops_the_tries_and_gets_no_answer():
    runner = ScriptedRunner(lambda shown, n: "1" * 81, delay=lambda shown: 0.05)
    sampler = resolve_sampler({"num_predict": 81, "task_tries": 24}, runner.metadata, 256)
    prompt_ids = runner.task.prompt([2], PUZZLE)
    cancel = threading.Event()
    threading.Timer(0.12, cancel.set).start()
    items = list(run_task(runner, answers.plan_generation(runner, prompt_ids, sampler, 16), sampler, cancel,
                          TaskRequest.read(runner, prompt_ids), 2, time.perf_counter()))
    assert items == [] and 2 <= len(runner.prompts) <= 8


def test_a_prompt_without_a_puzzle_is_a_one_line_400():
    runner = ScriptedRunner(lambda shown, n: SOLUTION)
    with pytest.raises(DgemmaError, match=r"^invalid sudoku puzzle: the latest message must be the 81 cells"):
        TaskRequest.read(runner, [2] + runner.tokenize("5300"))
    cells = [runner.task.cell_token[c, int(d)] for c, d in enumerate("55" + PUZZLE[2:])]
    with pytest.raises(DgemmaError, match=r"^invalid sudoku puzzle: digit 5 appears twice in row 1$"):
        TaskRequest.read(runner, [2] + cells)


def test_a_model_without_the_task_key_is_not_a_task_model():
    class TextRunner:
        metadata = {"tokenizer.ggml.tokens": TOKENS}  # the same vocabulary, no task key

    assert TaskRequest.read(TextRunner(), [2] + [3] * 81) is None
    with pytest.raises(DgemmaError, match="task 'chess' is not one this dgemma knows"):
        tasks.task_for({tasks.TASK_KEY: "chess"})


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

    outcome = first_solution(attempt, 8, workers, solved=lambda index: index in solving)
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

    outcome = first_solution(attempt, 4, 2, solved=lambda r: r == "solved")
    assert outcome.results == ["solved"] and outcome.started == 2 and seen == {1: (True, True)}


def test_a_try_that_raises_stops_the_pool_and_the_error_reaches_the_caller():
    def attempt(a):
        if a.index == 1:
            raise DgemmaError("engine failed")
        time.sleep(0.01)
        return False

    with pytest.raises(DgemmaError, match="engine failed"):
        TryPool(attempt, 6, solved=bool).run(2)


# ---- the bundled model through the ollama client -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """The REST app in-process on a fresh store (the bundled model registers itself on first use)."""
    from dgemma_cli.local_server import LocalServer

    server = LocalServer(models_dir=str(tmp_path_factory.mktemp("sudoku-task-store")))
    server.start()
    yield server.url
    server.stop()


def readme_puzzles() -> list[str]:
    found = re.findall(r"dgemma run sudoku (?:--visual --seed \d+ )?([0-9]{81})", (REPO / "README.md").read_text())
    assert PUZZLE in found and len(found) >= 2, found
    return sorted(set(found))


@pytest.mark.parametrize("puzzle", readme_puzzles())
def test_the_ollama_client_gets_run_s_answers_with_done_reason_stop(server_url, puzzle):
    import ollama

    client = ollama.Client(host=server_url)
    answer = client.chat(model="sudoku", messages=[{"role": "user", "content": puzzle}], options={"seed": 1})
    assert tasks.is_solution(puzzle, answer.message.content), answer.message.content
    assert answer.done_reason == "stop"
    streamed = list(client.generate(model="sudoku", prompt=puzzle, options={"seed": 1}, stream=True))
    assert "".join(c.response for c in streamed) == answer.message.content  # same seed, same tries, same grid
    assert streamed[-1].done_reason == "stop"


def test_an_unsolved_grid_says_length_and_a_puzzle_that_is_no_puzzle_is_a_400(server_url):
    import ollama

    client = ollama.Client(host=server_url)
    hard = "000000010400000000020000000000050407008000300001090000300400200050100000000806000"
    answer = client.chat(model="sudoku", messages=[{"role": "user", "content": hard}],
                         options={"seed": 1, "task_tries": 1, "diffusion_steps": 1})
    assert not tasks.is_solution(hard, answer.message.content) and answer.done_reason == "length"
    raw = httpx.post(f"{server_url}/api/generate", timeout=60, json={
        "model": "sudoku", "prompt": hard, "stream": False, "options": {"seed": 1, "task_tries": 2,
                                                                       "diffusion_steps": 1}}).json()
    assert (raw["done_reason"], raw["task_tries"], raw["canvases"]) == ("length", 2, 2)  # the ollama client drops it
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="sudoku", messages=[{"role": "user", "content": "hello"}])
    assert raised.value.status_code == 400 and "invalid sudoku puzzle" in raised.value.error
