"""The `--visual` live view, recorded with Rich's recording console across real generations streamed by the server
(scripted runner, preview chunks): every step gets a frame, the final output equals the committed text, styles
follow the sampler's accept mask, redraws are throttled, and the drawing overhead per step stays small."""
from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from dgemma_cli.live_view import RENOISED_STYLE, SETTLED_STYLE, LiveView
from dgemma_cli.wire import Progress, progress_of
from run_helpers import FakeBehaviour, InProcessServer, fake_factory, make_store

ANSWER = "Diffusion models write whole blocks at once, then refine them. ünïcödé ✓"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dgemma_cli.server.config import ServerConfig

    root = tmp_path_factory.mktemp("live-store")
    store = make_store(root / "models")
    behaviour = FakeBehaviour(answer=ANSWER, steps=4, canvas_length=16)
    with InProcessServer(ServerConfig.from_env({"DGEMMA_MODELS": str(root / "models")}), store,
                         fake_factory(behaviour)) as srv:
        yield srv, behaviour


def preview_chunks(url: str) -> list[dict]:
    import httpx

    from dgemma_cli import wire
    from dgemma_cli.client import Client

    with httpx.Client(base_url=url) as http:
        return list(Client(url, http).generate_stream(
            wire.GenerateRequest(model="tiny", prompt="hi", options={"diffusion_preview": True})))


def recording_console() -> Console:
    return Console(file=io.StringIO(), record=True, force_terminal=True, width=60, height=30, color_system="truecolor")


def test_every_step_is_drawn_and_the_final_output_is_the_committed_text(server):
    srv, behaviour = server
    chunks = preview_chunks(srv.url)
    progress = [c for c in chunks if "completed" in c and not c.get("done")]
    committed = "".join(c["response"] for c in chunks if not c.get("done"))
    assert committed == ANSWER
    canvases = -(-(len(ANSWER) + 1) // behaviour.canvas_length)
    assert len(progress) == canvases * behaviour.steps
    assert all(len(c["preview_tokens"]) == behaviour.canvas_length for c in progress)

    console = recording_console()
    frames: list[str] = []
    with LiveView(console, max_fps=None) as view:
        for chunk in chunks:
            if chunk.get("done"):
                continue
            if chunk in progress:
                view.on_progress(progress_of(chunk))
            else:
                view.on_text(chunk["response"])
            frames.append(console.export_text(clear=True))
    final = console.export_text(clear=True)

    step_frames = [frame for frame, chunk in zip(frames, (c for c in chunks if not c.get("done"))) if chunk in progress]
    assert len(step_frames) == len(progress) == view.steps_seen
    for frame, chunk in zip(step_frames, progress):
        counter = f"canvas {chunk['canvas']} · step {chunk['completed']}/{chunk['total']} · mean entropy 0.500 · accepted 1/16"
        assert counter in frame
        assert chunk["preview"].strip() in frame.replace("\n", "")  # the draft itself (wrapped at 60 columns)
    assert view.frames_drawn == len(frames)  # no throttling: every event drew a frame
    assert final == ANSWER + "\n"  # the live region gives way to exactly the committed text


def test_styles_follow_the_accept_mask():
    console = recording_console()
    view = LiveView(console, max_fps=None)
    view.on_progress(Progress.model_validate({"canvas": 1, "completed": 3, "total": 8, "preview": "abcd",
                      "preview_tokens": ["a", "b", "c", "d"], "preview_accepted": [1, 1, 0, 1]}))
    text = view.draft_text()
    assert text.plain == "abcd"
    styled = [(text.plain[span.start:span.end], span.style) for span in text.spans]
    assert styled == [("ab", SETTLED_STYLE), ("c", RENOISED_STYLE), ("d", SETTLED_STYLE)]


def test_without_a_mask_changed_positions_are_dimmed():
    view = LiveView(recording_console(), max_fps=None)
    view.on_progress(Progress.model_validate({"canvas": 1, "completed": 1, "total": 8, "preview_tokens": ["x", "y", "z"]}))
    view.on_progress(Progress.model_validate({"canvas": 1, "completed": 2, "total": 8, "preview_tokens": ["x", "Y", "z"]}))
    text = view.draft_text()
    assert [(text.plain[s.start:s.end], s.style) for s in text.spans] == [
        ("x", SETTLED_STYLE), ("Y", RENOISED_STYLE), ("z", SETTLED_STYLE)]
    view.on_progress(Progress.model_validate({"canvas": 2, "completed": 1, "total": 8, "preview": "new"}))  # a new canvas: nothing settled yet
    text = view.draft_text()
    assert [(text.plain[s.start:s.end], s.style) for s in text.spans] == [("new", RENOISED_STYLE)]


def test_redraws_are_throttled_but_commits_always_draw():
    now = [0.0]
    console = recording_console()
    with LiveView(console, max_fps=10.0, clock=lambda: now[0]) as view:
        for step in range(1, 251):  # 250 steps, 1 ms apart
            now[0] = step * 0.001
            view.on_progress(Progress.model_validate({"canvas": 1, "completed": step, "total": 250, "preview": "draft"}))
        view.on_text("done")
    assert view.steps_seen == 250
    assert view.frames_drawn == 3 + 1  # ~t = 0.001, 0.101, 0.201 s (10 frames/s), plus the commit


def test_drawing_overhead_per_step_is_small():
    """A 256-position canvas drawn at every step (no throttling: the worst case) on a terminal console."""
    pieces = [f"tok{i % 97} " for i in range(256)]
    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40)
    steps = 60
    started = time.perf_counter()
    with LiveView(console, max_fps=None) as view:
        for step in range(1, steps + 1):
            mask = [(i * 7 + step) % 3 != 0 for i in range(256)]
            view.on_progress(Progress.model_validate({"canvas": 1, "completed": step, "total": steps, "preview_tokens": pieces,
                              "preview_accepted": mask, "entropy": 0.4, "accepted": sum(mask)}))
    per_step_ms = (time.perf_counter() - started) / steps * 1e3
    print(f"live view: {per_step_ms:.2f} ms per drawn step (256 positions, unthrottled)")
    assert view.frames_drawn == steps
    assert per_step_ms < 50  # far below a denoising step of the real model; throttled views draw ~12 of these/s


# ---- the Sudoku grid (`dgemma run sudoku --visual`) ----------------------------------------------------------------

SUDOKU_PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def styles_of_givens(renderable, puzzle: str) -> list[str]:
    """The style each given cell of a drawn grid is printed in, in cell order."""
    console = Console(file=io.StringIO(), width=40, color_system="truecolor", force_terminal=True)
    cells = [(segment.text, str(segment.style or "")) for segment in console.render(renderable)
             if len(segment.text) == 1 and segment.text in "0123456789.?"]
    assert len(cells) == 81, cells
    return [style for (_, style), given in zip(cells, puzzle) if given != "0"]


def test_the_first_sudoku_frame_draws_the_givens_as_kept_clues():
    from dgemma_cli.sudoku import LiveGrid, grid_table

    view = LiveGrid(Console(file=io.StringIO(), width=40, force_terminal=True), SUDOKU_PUZZLE)
    first_frame = view.live.renderable  # what the live region shows before the first step
    view.stop()
    first = styles_of_givens(first_frame, SUDOKU_PUZZLE)
    assert len(first) == 30 and all(style == "bold" for style in first), first
    # a draft with no digit yet at a given is not a wrong clue either; another digit there is
    assert all(s == "bold" for s in styles_of_givens(grid_table(SUDOKU_PUZZLE, "?" * 81), SUDOKU_PUZZLE))
    wrong = "6" + SUDOKU_PUZZLE[1:]
    assert styles_of_givens(grid_table(SUDOKU_PUZZLE, wrong), SUDOKU_PUZZLE)[0] == "bold red"


def test_sudoku_frames_name_their_try_and_the_final_grid_says_whose_it_is():
    """Tries run one after another from fresh noise, so a frame without its try, or a final grid unlike the last
    frame with nothing said, reads as a glitch."""
    from dgemma_cli.sudoku import answer_caption, progress_counter
    from dgemma_cli.wire import Progress

    assert progress_counter(Progress(completed=12, total=12, canvas=1, task_try=1)) == "try 1 · step 12/12"
    assert progress_counter(Progress(completed=3, total=12, canvas=1, task_try=2)) == "try 2 · step 3/12"
    assert progress_counter(Progress(completed=3, total=12, canvas=1)) == "step 3/12"  # not a task model
    assert answer_caption(2, True) == "answer: try 2, a valid solution"
    assert answer_caption(48, False) == "answer: try 48, still breaks a rule"
