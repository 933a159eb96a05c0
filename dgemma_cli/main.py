"""`dgemma` command line entry point: registers each command module and turns user errors into one line."""
import sys

import typer

from dgemma_cli import cmd_convert, cmd_debug, cmd_run, cmd_serve, cmd_store, session, sudoku
from dgemma_cli.errors import DgemmaError

app = typer.Typer(
    name="dgemma",
    help="Run DiffusionGemma locally: convert, pull, run and serve block-diffusion models.",
    no_args_is_help=False,  # the root callback prints help itself (exit 0, as Ollama)
    add_completion=False,
    pretty_exceptions_enable=False,
)


def print_version() -> None:
    """`dgemma --version`, as Ollama: the running server's version, and a warning when it differs or none answers."""
    from dgemma_cli import __version__
    from dgemma_cli.client import client_base_url, http_client, server_answers

    with http_client(client_base_url()) as http:
        server_version = None
        if server_answers(http):
            try:
                server_version = http.get("/api/version").json().get("dgemma_version")
            except (ValueError, OSError, AttributeError):
                server_version = None
    if server_version is None:
        print("Warning: could not connect to a running dgemma instance")
        print(f"Warning: client version is {__version__}")
        return
    print(f"dgemma version is {server_version}")
    if server_version != __version__:
        print(f"Warning: client version is {__version__}")


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", "-v", help="Show the server's and the client's version."),
) -> None:
    """Run DiffusionGemma locally: convert, pull, run and serve block-diffusion models."""
    if version:
        print_version()
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit()


app.command("convert", cls=cmd_convert.ConvertCommand)(cmd_convert.convert)
app.add_typer(cmd_debug.app, name="debug")
cmd_serve.register(app)
cmd_store.register(app)
cmd_run.register(app)
session.register_task_renderer(sudoku.run_sudoku)


def main() -> None:
    try:
        app()
    except DgemmaError as exc:  # every package's user error (engine and converter ones derive from it)
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
