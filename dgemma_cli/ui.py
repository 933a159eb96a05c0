"""Terminal output shared by the commands: spinner, progress bars, tables, human sizes and durations (Ollama's wording).

`run`, the REPL, the Sudoku task and the store commands all draw with these, so each looks the same everywhere and
is defined once.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # the spinner of `run` and of the progress lines


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Spinner:
    """`⠋ denoising canvas 2 · step 17/48` on stderr, animated by a thread; a no-op when stderr is not a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool | None = None):
        self.stream = stream
        self.enabled = is_tty(stream) if enabled is None else enabled
        self.message = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False

    def start(self, message: str = "") -> "Spinner":
        self.message = message
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        return self

    def set(self, message: str) -> None:
        self.message = message

    def _spin(self) -> None:
        frame = 0
        while not self._stop.wait(0.1):
            with self._lock:
                if self._stop.is_set():
                    return
                self.stream.write(f"\r\x1b[K{SPINNER_FRAMES[frame % len(SPINNER_FRAMES)]} {self.message}")
                self.stream.flush()
                self._shown = True
            frame += 1

    def stop(self) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._stop.set()
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
        self._thread.join()
        self._thread = None


# ---- sizes, durations, tables ----------------------------------------------------------------------------------------

def human_bytes(n: int) -> str:
    """Decimal units: `16 GB`, `986 MB`, `4.7 GB`, `1 GB`, `512 B`."""
    if n < 1000:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 1000:
            break
    if value >= 10:
        return f"{int(value)} {unit}"
    return f"{int(value)} {unit}" if value == int(value) else f"{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """Go's units.HumanDuration, as Ollama's `list` uses it."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds // 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds // 3600) // 24 // 365} years"


def human_time_ago(timestamp: float, now: float | None = None) -> str:
    return human_duration((now if now is not None else time.time()) - timestamp) + " ago"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, 4 spaces apart, no borders (list, ps)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("    ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- progress --------------------------------------------------------------------------------------------------------

def remaining_text(seconds: float) -> str:
    """Time left as Ollama prints it: `45s`, `2m3s`, `1h5m`, `99h+`."""
    s = int(round(seconds))
    if s >= 100 * 3600:
        return "99h+"
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    if h:
        return f"{h}h{m}m"
    return f"{m}m{sec}s" if m else f"{sec}s"


@dataclass
class _Bar:
    label: str
    total: int
    completed: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=50))  # (time, completed) for the rate

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


def bar_line(label: str, completed: int, total: int, rate: float, width: int) -> str:
    """`pulling 8eeb52dfb3bb:  45% ▕███████         ▏ 2.1 GB/4.7 GB   12 MB/s   2m3s`, fitted to `width`."""
    pct = min(100, int(100 * completed / total)) if total else 100
    if completed >= total:
        stats = human_bytes(total)
    else:
        stats = f"{human_bytes(completed)}/{human_bytes(total)}"
        if rate > 0:
            stats += f"  {human_bytes(int(rate))}/s  {remaining_text((total - completed) / rate)}"
    left = f"{label}: {pct:3d}% "
    bar_width = max(10, width - len(left) - len(stats) - 3)
    filled = bar_width * pct // 100
    return f"{left}▕{'█' * filled}{' ' * (bar_width - filled)}▏ {stats}"


class ProgressRenderer:
    """Ollama-like progress on stderr: one bar per digest and plain status lines, redrawn in place on a terminal.
    Elsewhere (logs, pipes) each status line, and each bar once complete, is printed once, whole."""

    SPINNER = SPINNER_FRAMES

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.lines: list[str | _Bar] = []
        self.bars: dict[str, _Bar] = {}
        self.frame = 0
        self.live = Live(console=self.console, refresh_per_second=8, transient=False, get_renderable=self.render)

    def render(self) -> Text:
        self.frame += 1
        width = self.console.width
        out = []
        for i, line in enumerate(self.lines):
            if isinstance(line, _Bar):
                out.append(bar_line(line.label, line.completed, line.total, line.rate(), width))
            elif i == len(self.lines) - 1 and line != "success" and self.live.is_started and self.console.is_terminal:
                out.append(f"{line} {self.SPINNER[self.frame % len(self.SPINNER)]}")
            else:
                out.append(line)
        return Text("\n".join(out), overflow="fold")

    def __enter__(self) -> "ProgressRenderer":
        if self.console.is_terminal:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live.is_started:
            self.live.stop()

    def _log(self, line: str) -> None:
        if not self.console.is_terminal:
            print(line, file=self.console.file, flush=True)

    def update(self, event: dict[str, Any]) -> None:
        digest, status = event.get("digest"), event.get("status", "")
        if digest and event.get("total") is not None:
            completed = event.get("completed", 0)
            bar = self.bars.get(digest)
            if bar is None:
                if not completed:
                    return  # Ollama does not draw a layer's first `completed: 0` update
                bar = self.bars[digest] = _Bar(status, event["total"])
                self.lines.append(bar)
            if completed >= bar.total > bar.completed or completed == bar.total == 0:
                self._log(bar_line(bar.label, completed, bar.total, 0.0, 80))
            bar.completed = completed
            bar.samples.append((time.monotonic(), completed))
        elif status and (not self.lines or self.lines[-1] != status):
            self.lines.append(status)
            self._log(status)

    def run(self, events: Iterable[dict[str, Any]]) -> None:
        with self:
            for event in events:
                self.update(event)
