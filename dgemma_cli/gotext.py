"""Go's text forms as Ollama reads and prints them: durations (`1h30m`, `300ms`), `keep_alive`, `%#v` values.

Ollama clients send `keep_alive` as a number of seconds or as a Go `time.Duration` string; the CLI prints durations in
Go's text form. Both directions live here so the server and the CLI agree on one grammar.
"""
import json
import math
import re
from typing import Any

from dgemma_cli.errors import DgemmaError, out_of_range

_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 micro sign, what Go prints
    "μs": 1e-6,  # U+03BC greek mu, what Go also accepts
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")

FOREVER = math.inf
MAX_DURATION_SECONDS = (2**63 - 1) / 1e9  # Go's longest time.Duration, about 292 years


def parse_go_duration(text: str) -> float:
    """Seconds for a Go duration string such as `1h30m`, `-5m`, `300ms` or `0`; DgemmaError on anything else."""
    s = text.strip()
    sign = 1.0
    if s and s[0] in "+-":
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise DgemmaError(f'time: invalid duration "{text}"')
    total = 0.0
    pos = 0
    while pos < len(s):
        match = _PART.match(s, pos)
        if match is None:
            raise DgemmaError(f'time: invalid duration "{text}"')
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    return sign * total


def parse_keep_alive(value: object) -> float | None:
    """Residency in seconds from a request's `keep_alive`: None when absent, `FOREVER` when negative.

    Numbers are seconds (floats allowed); strings are Go durations, or digits meaning seconds (dgemma's extension).
    Booleans and other JSON types are rejected, as Ollama does.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise DgemmaError("keep_alive must be a number of seconds or a duration string")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        seconds = float(text) if re.fullmatch(r"[+-]?\d+(\.\d+)?", text) else parse_go_duration(text)
    else:
        raise DgemmaError("keep_alive must be a number of seconds or a duration string")
    if math.isnan(seconds):
        raise DgemmaError("keep_alive must be a number of seconds or a duration string")
    if seconds < 0:
        return FOREVER
    if seconds > MAX_DURATION_SECONDS:  # Go's Duration ends here, and expiry times must stay printable dates
        raise out_of_range("keep_alive")
    return seconds


def _trim_fraction(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def go_duration(ns: int) -> str:
    """Go's `time.Duration.String()` for a nanosecond count: `1h2m3.5s`, `4.23s`, `812.3ms`, `950µs`, `17ns`, `0s`."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(int(ns))
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_trim_fraction(ns / 1e3, 3)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_trim_fraction(ns / 1e6, 6)}ms"
    hours, rest = divmod(ns, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    seconds = _trim_fraction(rest / 1e9, 9)
    text = f"{seconds}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def go_value(value: Any, wire: bool = False) -> str:
    """A scalar in Go's `%#v` style: strings double-quoted, booleans `true`/`false`, numbers bare.

    Two spellings are kept, each byte-identical to what it always was: the CLI's (`wire=False`: strings escaped as
    JSON, integral floats without `.0`, as Go prints them) and the `/api/show` `parameters` text (`wire=True`: only
    backslash, quote and newline escaped, floats as Python prints them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if wire:
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and not wire:
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)
