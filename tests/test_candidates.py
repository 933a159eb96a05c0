"""num_canvases: candidate canvases denoised together in one batched decoder step, and the choice among them.

On the tiny fixture models (real engine, real sampler): a batched step computes what separate steps compute; N = 1
through a multi-canvas context is the plain run; N candidates take as many decoder passes as their longest member
(not the sum); the committed candidate is the first that passes a checker, else the lowest final mean entropy; a
checker's violations send positions back into denoising (self-correction).
"""
from __future__ import annotations

import numpy as np
import pytest

from dgemma_engine.errors import DgemmaError, EngineError
from dgemma_engine.generate import CANDIDATE_SEED_STRIDE, CanvasEvent, SamplerParams, StepEvent, generate
from dgemma_engine.model import Context, Model
from dgemma_engine.settings import SettingError, check_values
from dgemma_engine.tasks import SudokuTask, sudoku_violations

PROMPT = [2, 17, 40, 33, 101, 7, 250, 64, 12]


@pytest.fixture(scope="module")
def model(gguf_path):
    with Model.load(gguf_path("tiny-a", "f32"), threads=1) as m:
        yield m


class CountingContext:
    """A real context that counts decoder passes and the canvas rows they held."""

    def __init__(self, ctx: Context):
        self._ctx, self.passes, self.rows = ctx, 0, 0

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def step(self, canvas, sc_temperature=None):
        self.passes += 1
        self.rows += np.asarray(canvas).size
        return self._ctx.step(canvas, sc_temperature=sc_temperature)


def run(model, n_canvases: int, seed: int, checker=None, self_correct: bool = True, max_canvases: int | None = None,
        **overrides) -> tuple[list[StepEvent], CanvasEvent, CountingContext]:
    params = SamplerParams.from_metadata(model.metadata, seed=seed, rng="torch", num_canvases=n_canvases, **overrides)
    C = model.hparams.canvas_length
    with Context(model, n_ctx=64, threads=1, max_canvases=max_canvases or n_canvases) as raw:
        ctx = CountingContext(raw)
        events = list(generate(ctx, PROMPT, params, max_new_tokens=C, eos_ids=(), checker=checker,
                               self_correct=self_correct, threads=1))
    steps = [e for e in events if isinstance(e, StepEvent)]
    (canvas,) = [e for e in events if isinstance(e, CanvasEvent)]
    return steps, canvas, ctx


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])  # q8_0: self-conditioning through the soft-embedding op
def test_a_batched_step_computes_each_candidate_as_a_separate_step(gguf_path, outtype):
    with Model.load(gguf_path("tiny-a", outtype), threads=1) as model:
        check_batched_step(model)


def check_batched_step(model):
    C, V = model.hparams.canvas_length, model.hparams.n_vocab
    rng = np.random.default_rng(3)
    candidates = rng.integers(0, V, (3, C))
    alone = []
    with Context(model, n_ctx=64, threads=1) as ctx:
        for canvas in candidates:
            ctx.reset()
            ctx.encode(PROMPT)
            first = ctx.step(canvas).copy()
            alone.append((first, ctx.step(canvas, sc_temperature=0.7).copy()))
    with Context(model, n_ctx=64, threads=1, max_canvases=4) as ctx:
        ctx.encode(PROMPT)
        first = ctx.step(candidates).copy()
        second = ctx.step(candidates, sc_temperature=0.7).copy()
        assert first.shape == (3 * C, V)
        for k, (want_first, want_second) in enumerate(alone):  # each attends over the one-canvas layout: bit for bit
            np.testing.assert_array_equal(first[k * C:(k + 1) * C], want_first)
            np.testing.assert_array_equal(second[k * C:(k + 1) * C], want_second)
        # candidate 1 leaves the batch: the next self-conditioned step runs on candidates 0 and 2 alone
        ctx.step(candidates)
        ctx.keep_canvases([True, False, True])
        kept = ctx.step(candidates[[0, 2]], sc_temperature=0.7)
        np.testing.assert_allclose(kept[:C], alone[0][1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(kept[C:], alone[2][1], atol=1e-4, rtol=0)
        with pytest.raises(EngineError, match="5 canvases in one step; this context holds 1..4"):
            ctx.step(rng.integers(0, V, (5, C)))


def test_one_candidate_in_a_multi_canvas_context_is_the_plain_run(model):
    plain_steps, plain, _ = run(model, 1, seed=5)
    steps, canvas, _ = run(model, 1, seed=5, max_canvases=4)
    assert canvas.canvas == plain.canvas and canvas.steps == plain.steps
    assert [s.argmax_ids for s in steps] == [s.argmax_ids for s in plain_steps]


def test_candidates_share_decoder_passes(model):
    """Four candidates cost as many decoder passes as the longest of them, against the sum for four runs."""
    singles = [run(model, 1, seed=11 + k * CANDIDATE_SEED_STRIDE) for k in range(4)]
    _, _, ctx = run(model, 4, seed=11)
    sequential = sum(c.passes for _, _, c in singles)
    assert ctx.passes == max(c.passes for _, _, c in singles) < sequential
    assert ctx.rows == sum(c.rows for _, _, c in singles)  # finished candidates leave the batch


def test_without_a_checker_the_lowest_final_entropy_wins(model):
    singles = [run(model, 1, seed=21 + k * CANDIDATE_SEED_STRIDE) for k in range(3)]
    final_entropy = [steps[-1].mean_entropy for steps, _, _ in singles]
    best = int(np.argmin(final_entropy))
    _, canvas, _ = run(model, 3, seed=21)
    assert canvas.candidate == best and canvas.checked is None
    assert canvas.canvas == singles[best][1].canvas


class PassOnly:
    """A checker that passes one given canvas and flags position 0 of every other."""

    def __init__(self, passing: list[int]):
        self.passing, self.calls = passing, 0

    def violations(self, canvas):
        self.calls += 1
        return [] if list(canvas) == self.passing else [0]


def test_the_first_candidate_passing_the_checker_wins(model):
    singles = [run(model, 1, seed=31 + k * CANDIDATE_SEED_STRIDE) for k in range(3)]
    final_entropy = [steps[-1].mean_entropy for steps, _, _ in singles]
    target = int(np.argmax(final_entropy))  # never the entropy rule's choice
    _, canvas, _ = run(model, 3, seed=31, checker=PassOnly(singles[target][1].canvas), self_correct=False)
    assert canvas.candidate == target and canvas.checked is True
    # nobody passes: the entropy rule, and the verdict says so
    _, canvas, _ = run(model, 3, seed=31, checker=PassOnly([-1]), self_correct=False)
    assert canvas.candidate == int(np.argmin(final_entropy)) and canvas.checked is False


class FlagOnce:
    """Flags positions 0 and 1 of the first canvas it sees, passes everything after."""

    def __init__(self):
        self.seen = 0

    def violations(self, canvas):
        self.seen += 1
        return [0, 1] if self.seen == 1 else []


def test_self_correction_sends_violating_positions_back_to_denoising(model):
    early = {"confidence_threshold": 50.0, "stability_threshold": 0}  # the random tiny model stops at once
    plain_steps, plain, _ = run(model, 1, seed=41, **early)
    assert plain.steps < 48
    checker = FlagOnce()
    steps, canvas, _ = run(model, 1, seed=41, checker=checker, **early)
    assert checker.seen == 2 and canvas.checked is True
    assert canvas.steps > plain.steps  # it denoised on after the first finish
    assert [s.argmax_ids for s in steps[:len(plain_steps)]] == [s.argmax_ids for s in plain_steps]
    _, again, _ = run(model, 1, seed=41, checker=FlagOnce(), self_correct=False, **early)
    assert again.steps == plain.steps and again.checked is False


def test_num_canvases_range_and_context_size(model):
    check_values({"num_canvases": 16})
    for bad in (0, 17):
        with pytest.raises(SettingError, match=rf"^invalid value for num_canvases: {bad} \(must be between 1 and 16\)$"):
            check_values({"num_canvases": bad})
    with pytest.raises(EngineError, match="num_canvases 3 needs a context made for that many canvases"):
        run(model, 3, seed=1, max_canvases=2)


# ---- the Sudoku checker ---------------------------------------------------------------------------------------------

SOLVED = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def test_sudoku_violations_name_the_cells_that_break_a_rule():
    grid = [int(ch) for ch in SOLVED]
    assert sudoku_violations(PUZZLE, grid) == []
    swapped = list(grid)
    swapped[2], swapped[3] = swapped[3], swapped[2]  # cells 2 and 3: both blanks in the puzzle, now repeated in columns
    assert set(sudoku_violations(PUZZLE, swapped)) >= {2, 3}
    wrong_given = list(grid)
    wrong_given[0] = 9  # a given not kept (and a repeat in its row)
    assert 0 in sudoku_violations(PUZZLE, wrong_given)
    assert 2 in sudoku_violations(PUZZLE, grid[:2] + [0] + grid[3:])  # no digit


def test_the_sudoku_task_reads_the_puzzle_from_the_prompt_and_checks_answers():
    tokens = ["<pad>", "<eos>", "<bos>"] + [str(d) for d in range(10)] + \
        [f"<c{cell}={digit}>" for cell in range(81) for digit in range(10)]
    cell_id = {t: i for i, t in enumerate(tokens)}
    prompt = [2] + [cell_id[f"<c{i}={ch}>"] for i, ch in enumerate(PUZZLE)]
    task = SudokuTask.for_vocabulary(tokens)
    assert task.read_prompt(prompt) == ([2], PUZZLE) and task.prompt([2], PUZZLE) == prompt
    checker = task.checker(PUZZLE)
    answer = [tokens.index(ch) for ch in SOLVED]
    assert checker.violations(answer) == []
    assert checker.violations([tokens.index("0")] * 81) == list(range(81))
    with pytest.raises(DgemmaError, match="invalid sudoku puzzle"):
        task.read_prompt(prompt[:-1] + [3])  # not the cell tokens in order
