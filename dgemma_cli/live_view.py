"""`dgemma run --visual`: the canvas denoising live in the terminal (Rich).

Fed by the server's opt-in preview stream (docs/compat.md#streaming-shape): each progress chunk carries the current
argmax draft of the canvas being denoised. The frame shows the tail of the committed text, the draft with settled
positions in one style and still-changing (renoised) positions dimmed, and a counter line (canvas, step k/N, mean
entropy, accepted positions). Redraws are throttled to `max_fps` so drawing never dominates the step time; a canvas
commit always redraws. When the generation ends the live region is replaced by the committed text, printed plainly.

A chunk is read as the wire's `Progress` record (dgemma_cli/wire.py), so the names are the server's. Per-position
detail comes from its optional fields when the server sends them: `preview_tokens` (the draft as one string per canvas
position) and `preview_accepted` (0/1 per position: kept by the sampler this step). Without them the draft string is
compared with the previous step's, character by character.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from dgemma_cli.wire import Progress

SETTLED_STYLE = "bold"
RENOISED_STYLE = "dim"
THINKING_STYLE = "dim italic"
COUNTER_STYLE = "cyan"
COMMITTED_TAIL_LINES = 6


@dataclass
class Draft:
    """One step of one canvas as the server described it, with the draft split per position: the chunk's
    `preview_tokens` / `preview_accepted`, or derived from `preview` when it sent only that."""

    progress: Progress
    preview_tokens: list[str]
    preview_accepted: list[bool]

    def counter(self) -> str:
        step = self.progress
        parts = [f"canvas {step.canvas}", f"step {step.completed}/{step.total}"]
        if step.entropy is not None:
            parts.append(f"mean entropy {step.entropy:.3f}")
        if step.accepted is not None:
            parts.append(f"accepted {step.accepted}/{len(self.preview_tokens)}")
        return " · ".join(parts)


def draft_of(progress: Progress, previous: list[str]) -> Draft:
    """Positions unchanged since the previous step count as settled when the server did not say which were kept."""
    tokens = progress.preview_tokens
    if tokens is not None:
        accepted = progress.preview_accepted
        if accepted is not None and len(accepted) == len(tokens):
            return Draft(progress, list(tokens), list(accepted))
        return Draft(progress, list(tokens), [i < len(previous) and previous[i] == t for i, t in enumerate(tokens)])
    chars = list(progress.preview or "")
    return Draft(progress, chars, [i < len(previous) and previous[i] == c for i, c in enumerate(chars)])


@dataclass
class LiveView:
    """Draws into `console` (a terminal); use as a context manager around one generation."""

    console: Console
    max_fps: float | None = 12.0  # None: draw every step (tests)
    hide_thinking: bool = False
    clock: Callable[[], float] = time.perf_counter
    answer: str = ""
    thinking: str = ""
    draft: Draft | None = None
    steps_seen: int = 0
    frames_drawn: int = 0
    handler_seconds: float = 0.0  # time spent in step handling + drawing, for the overhead measurement
    _last_draw: float = field(default=-1e9, repr=False)
    _live: Live | None = field(default=None, repr=False)

    # ---- lifecycle -------------------------------------------------------------------------------------------------

    def __enter__(self) -> "LiveView":
        self._live = Live(console=self.console, auto_refresh=False, transient=True, redirect_stdout=False,
                          redirect_stderr=False, vertical_overflow="crop")
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        """Replace the live region by the committed output (thinking dimmed unless hidden), printed once."""
        if self._live is None:
            return
        self._live.update(Group())  # Live.stop() redraws once: make that redraw erase the region instead
        self._live.stop()
        self._live = None
        final = self.final_text()
        if final.plain:
            self.console.print(final, end="" if final.plain.endswith("\n") else "\n", soft_wrap=True)

    # ---- events ----------------------------------------------------------------------------------------------------

    def on_progress(self, progress: Progress) -> None:
        started = self.clock()
        same_canvas = self.draft is not None and self.draft.progress.canvas == progress.canvas
        self.draft = draft_of(progress, self.draft.preview_tokens if same_canvas else [])
        self.steps_seen += 1
        if self.max_fps is None or started - self._last_draw >= 1.0 / self.max_fps:
            self._draw(started)
        self.handler_seconds += self.clock() - started

    def on_text(self, content: str = "", thinking: str = "") -> None:
        """Committed text arrived: the canvas is done, its draft gives way to the text (always redrawn)."""
        started = self.clock()
        self.answer += content
        self.thinking += thinking
        self.draft = None
        self._draw(started)
        self.handler_seconds += self.clock() - started

    # ---- drawing ---------------------------------------------------------------------------------------------------

    def final_text(self) -> Text:
        text = Text()
        if self.thinking and not self.hide_thinking:
            text.append("Thinking...\n" + self.thinking + "\n...done thinking.\n\n", style=THINKING_STYLE)
        text.append(self.answer)
        return text

    def frame(self) -> Group:
        """What the live region shows now: committed tail, the draft, the counter line."""
        parts: list[Any] = []
        committed = Text()
        if self.thinking and not self.hide_thinking:
            committed.append(self.thinking, style=THINKING_STYLE)
            if self.answer:
                committed.append("\n")
        committed.append(self.answer)
        if committed.plain:
            lines = committed.wrap(self.console, self.console.width)
            parts.append(Text("\n").join(lines[-COMMITTED_TAIL_LINES:]))
        if self.draft is not None:
            parts.append(self.draft_text())
            parts.append(Text(self.draft.counter(), style=COUNTER_STYLE))
        return Group(*parts)

    def draft_text(self) -> Text:
        """The current draft, one style per run of settled / renoised positions (few spans: cheap to render)."""
        draft = Text()
        if self.draft is None:
            return draft
        run, run_settled = "", None
        for piece, settled in zip(self.draft.preview_tokens, self.draft.preview_accepted):
            if settled != run_settled and run:
                draft.append(run, style=SETTLED_STYLE if run_settled else RENOISED_STYLE)
                run = ""
            run, run_settled = run + piece, settled
        if run:
            draft.append(run, style=SETTLED_STYLE if run_settled else RENOISED_STYLE)
        return draft

    def _draw(self, now: float) -> None:
        if self._live is None:
            return
        self._live.update(self.frame(), refresh=True)
        self.frames_drawn += 1
        self._last_draw = now
