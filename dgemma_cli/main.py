"""`dgemma` command line entry point: registers each command module and turns user errors into one line."""
import sys

import typer

from dgemma_cli import cmd_convert, cmd_debug, cmd_run, cmd_serve, cmd_store, sudoku

app = typer.Typer(
    name="dgemma",
    help="Run DiffusionGemma locally: convert, pull, run and serve block-diffusion models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("convert")(cmd_convert.convert)
app.add_typer(cmd_debug.app, name="debug")
cmd_serve.register(app)
cmd_store.register(app)
cmd_run.register(app)
cmd_run.register_task_renderer(sudoku.run_sudoku)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every package's user-error class: these become `Error: <message>` and exit status 1."""
    from dgemma_cli.errors import DgemmaError

    types: list[type[BaseException]] = [DgemmaError]
    try:
        from dgemma_convert.errors import ConvertError

        types.append(ConvertError)
    except ImportError:
        pass
    try:
        from dgemma_engine.errors import EngineError

        types.append(EngineError)
    except ImportError:
        pass
    return tuple(types)


def main() -> None:
    try:
        app()
    except user_error_types() as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
