"""Text output of `dgemma run`: the `--verbose` timing block, thinking blocks and word wrapping.

Ollama's wording and layout are kept exactly (docs/compat.md#run, #output-formats) so that scripts and eyes used to
`ollama run` read dgemma's output the same way.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from dgemma_cli.gotext import go_duration

LABEL_WIDTH = 22  # "prompt eval duration: " is the longest label


def _line(label: str, value: str) -> str:
    return f"{label + ':':<{LABEL_WIDTH}}{value}"


def _rate(count: int, duration_ns: int) -> str:
    return f"{count / (duration_ns / 1e9):.2f}"


def _bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} B"


def timing_block(final: dict[str, Any]) -> str:
    """Ollama's `--verbose` statistics from a final response object, zero-valued lines omitted; then dgemma's diffusion
    lines: steps run, canvases, mean steps per canvas and the denoising rate (steps per second of eval time), the
    bytes a step copied between the host and the devices (when any unit is off the CPU), and a task model's tries."""
    from dgemma_cli.wire import Metrics  # pydantic costs a CLI start ~0.1 s: loaded only when a block is printed

    m = Metrics.model_validate({key: value for key, value in final.items() if value is not None})
    lines = []
    if m.total_duration:
        lines.append(_line("total duration", go_duration(m.total_duration)))
    if m.load_duration:
        lines.append(_line("load duration", go_duration(m.load_duration)))
    if m.prompt_eval_count:
        lines.append(_line("prompt eval count", f"{m.prompt_eval_count} token(s)"))
    if m.prompt_eval_duration:
        lines.append(_line("prompt eval duration", go_duration(m.prompt_eval_duration)))
        lines.append(_line("prompt eval rate", f"{_rate(m.prompt_eval_count, m.prompt_eval_duration)} tokens/s"))
    if m.eval_count:
        lines.append(_line("eval count", f"{m.eval_count} token(s)"))
    if m.eval_duration:
        lines.append(_line("eval duration", go_duration(m.eval_duration)))
        lines.append(_line("eval rate", f"{_rate(m.eval_count, m.eval_duration)} tokens/s"))
    if m.denoise_steps:
        lines.append(_line("denoise steps", str(m.denoise_steps)))
    if m.canvases:
        lines.append(_line("canvases", str(m.canvases)))
    if m.denoise_steps and m.canvases:
        lines.append(_line("steps per canvas", f"{m.denoise_steps / m.canvases:.2f}"))
    if m.denoise_steps and m.eval_duration:
        lines.append(_line("denoise rate", f"{_rate(m.denoise_steps, m.eval_duration)} steps/s"))
    if m.host_bytes_per_step:
        lines.append(_line("host bytes per step", _bytes(m.host_bytes_per_step)))
    if m.task_tries:
        lines.append(_line("task tries", str(m.task_tries)))
    return "\n".join(lines)


class WordWrapper:
    """Streaming word wrap at `width` columns: a word that would cross the edge starts a new line (the spaces before
    it are dropped, so lines carry no trailing blanks). Words and spaces are held until the next character that
    decides their place arrives; `flush()` releases the last word."""

    def __init__(self, width: int):
        self.width = max(10, width)
        self.column = 0
        self.word = ""
        self.spaces = 0

    def _place_word(self) -> str:
        if not self.word:
            return ""
        out = ""
        if self.column and self.column + self.spaces + len(self.word) > self.width:
            out, self.column = "\n", 0
        else:
            out, self.column = " " * self.spaces, self.column + self.spaces
        out += self.word
        self.column += len(self.word)
        self.word, self.spaces = "", 0
        return out

    def feed(self, text: str) -> str:
        out = ""
        for ch in text:
            if ch == "\n":
                out += self._place_word() + "\n"
                self.column = self.spaces = 0
            elif ch == " ":
                out += self._place_word()
                self.spaces += 1
            else:
                self.word += ch
        return out

    def flush(self) -> str:
        return self._place_word()


DIM = "\x1b[2m"
RESET = "\x1b[0m"


@dataclass
class AnswerPrinter:
    """Prints streamed `content` and `thinking` the way `ollama run` does: a dimmed `Thinking...` block (hidden with
    `hide_thinking`), then the answer; optional word wrap; colours only on a terminal."""

    out: TextIO = sys.stdout
    color: bool = False
    wrap_width: int | None = None
    hide_thinking: bool = False

    def __post_init__(self) -> None:
        self.state = "start"  # start -> thinking -> answer
        self.wrapper = WordWrapper(self.wrap_width) if self.wrap_width else None
        self.printed_any = False
        self.last_char = "\n"

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.printed_any = True
            self.last_char = text[-1]

    def _wrapped(self, text: str) -> str:
        return self.wrapper.feed(text) if self.wrapper else text

    def thinking(self, text: str) -> None:
        if not text or self.hide_thinking:
            return
        if self.state == "start":
            self._write((DIM if self.color else "") + "Thinking...\n")
            self.state = "thinking"
        self._write(self._wrapped(text))

    def content(self, text: str) -> None:
        if not text:
            return
        if self.state == "thinking":
            tail = self.wrapper.flush() if self.wrapper else ""
            self._write(tail + "\n...done thinking.\n\n" + (RESET if self.color else ""))
            if self.wrapper:
                self.wrapper = WordWrapper(self.wrapper.width)
        self.state = "answer"
        self._write(self._wrapped(text))

    def finish(self) -> None:
        """End of the answer: the held word, closing the thinking block if no answer followed, a final newline."""
        if self.wrapper:
            self._write(self.wrapper.flush())
        if self.state == "thinking":
            self._write("\n...done thinking.\n" + (RESET if self.color else ""))
        if self.printed_any and self.last_char != "\n":
            self._write("\n")
