"""Output pieces of `dgemma run`: the `--verbose` block (docs/compat.md#run example), streaming word wrap, the thinking
block, and `ps` columns."""
from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone

from dgemma_cli.cmd_run import _processor, _until, parse_think
from dgemma_cli.render import AnswerPrinter, WordWrapper, timing_block


def test_timing_block_matches_the_spec_example():
    final = {"total_duration": 5216743012, "load_duration": 12480000, "prompt_eval_count": 26,
             "prompt_eval_duration": 130200000, "eval_count": 259, "eval_duration": 4230000000,
             "denoise_steps": 37, "canvases": 2}
    assert timing_block(final).splitlines() == [
        "total duration:       5.216743012s",
        "load duration:        12.48ms",
        "prompt eval count:    26 token(s)",
        "prompt eval duration: 130.2ms",
        "prompt eval rate:     199.69 tokens/s",
        "eval count:           259 token(s)",
        "eval duration:        4.23s",
        "eval rate:            61.23 tokens/s",
        "denoise steps:        37",
        "canvases:             2",
        "steps per canvas:     18.50",
        "denoise rate:         8.75 steps/s",
    ]


def test_timing_block_omits_zero_values():
    lines = timing_block({"total_duration": 950000, "eval_count": 0, "denoise_steps": 0}).splitlines()
    assert lines == ["total duration:       950µs"]


def test_timing_block_shows_what_a_step_copied_off_the_cpu():
    block = timing_block({"eval_duration": 10**9, "denoise_steps": 4, "host_bytes_per_step": 9216})
    assert block.splitlines()[-1] == "host bytes per step:  9.2 kB"
    assert timing_block({"host_bytes_per_step": 268438528}) == "host bytes per step:  268.44 MB"
    assert "host bytes" not in timing_block({"denoise_steps": 4})  # every unit on the CPU: the server sends none


def wrap(text: str, width: int, pieces: int = 3) -> str:
    wrapper = WordWrapper(width)
    step = max(1, len(text) // pieces)
    out = "".join(wrapper.feed(text[i:i + step]) for i in range(0, len(text), step))
    return out + wrapper.flush()


def test_word_wrap_breaks_before_words_that_cross_the_edge():
    text = "The quick brown fox jumps over the lazy dog.\nNew paragraph here."
    out = wrap(text, 20)
    assert out == "The quick brown fox\njumps over the lazy\ndog.\nNew paragraph here."
    assert all(len(line) <= 20 for line in out.splitlines())
    assert out.replace("\n", " ").split() == text.replace("\n", " ").split()  # no text lost or reordered
    assert wrap("x" * 30 + " y", 20) == "x" * 30 + "\ny"  # an over-long word stands alone


def test_thinking_block_then_answer_and_hidden_thinking():
    out = io.StringIO()
    printer = AnswerPrinter(out=out)
    for piece in ("Let me ", "think."):
        printer.thinking(piece)
    printer.content("The answer.")
    printer.finish()
    assert out.getvalue() == "Thinking...\nLet me think.\n...done thinking.\n\nThe answer.\n"
    hidden = io.StringIO()
    printer = AnswerPrinter(out=hidden, hide_thinking=True)
    printer.thinking("secret")
    printer.content("The answer.")
    printer.finish()
    assert hidden.getvalue() == "The answer.\n"
    colored = io.StringIO()
    printer = AnswerPrinter(out=colored, color=True)
    printer.thinking("t")
    printer.content("a")
    printer.finish()
    assert colored.getvalue() == "\x1b[2mThinking...\nt\n...done thinking.\n\n\x1b[0ma\n"


def test_ps_columns():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert _until((now + timedelta(minutes=4, seconds=30)).isoformat(), now) == "4 minutes from now"
    assert _until((now + timedelta(days=365 * 290)).isoformat(), now) == "Forever"
    assert _until((now - timedelta(seconds=1)).isoformat(), now) == "Stopping..."
    assert (_processor(100, 100), _processor(100, 0), _processor(100, 52)) == ("100% GPU", "100% CPU", "48%/52% CPU/GPU")


def test_think_values():
    assert [parse_think(v) for v in (None, "true", "False", "high", "max")] == [None, True, False, "high", "max"]
