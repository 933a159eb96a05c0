"""Running `dgemma` store commands in tests: an environment that isolates them, and the real entry point in-process."""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from server_harness import free_port


def cli_env(tmp_path: Path, host: str | None = None) -> dict[str, str]:
    """The store under tmp_path and a DGEMMA_HOST: `host`, or a port where nothing listens, so each command serves
    the API in-process (docs/compat.md#cli-surface) and never talks to a `dgemma serve` someone runs on the default
    port."""
    return {"DGEMMA_MODELS": str(tmp_path / "store"), "DGEMMA_HOST": host or f"127.0.0.1:{free_port()}"}


def in_process(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """Run `dgemma ARGS` through the real entry point (error wrapper included) without a new interpreter."""
    from dgemma_cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv = dict(os.environ), sys.argv
    os.environ.update(env)
    sys.argv = ["dgemma", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()
