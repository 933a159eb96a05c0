"""What a new user meets first (issue 26, item 5): `create`'s missing-Modelfile errors, the bundled model staying
deleted after `rm`, `stop` of a known but unloaded model, `run` of a model neither stored nor pullable, the variables
in `serve --help`, the output types in `convert --help`, `show` of an empty field and its Diffusion labels. Every
error is one `Error:` line with a non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from cli_helpers import cli_env, in_process
from server_harness import REPO, FakeBehaviour, InProcessServer, add_model, fake_factory, free_port, write_small_gguf
from store_helpers import write_tiny_gguf

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def dgemma_process(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    """`dgemma ARGS` in its own process, as a terminal of `columns` columns would lay out help."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    env.update(COLUMNS=str(columns), NO_COLOR="1", TERM="dumb",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", *args], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture
def served(tmp_path):
    """A running server (scripted runner) over a store holding `plain` (no license, system or parameters) and
    `licensed`."""
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import MEDIA_LICENSE, Layer, Store, build_manifest

    store = Store(tmp_path / "server-store")
    gguf = write_small_gguf(tmp_path / "small.gguf")
    add_model(store, "plain", gguf)
    add_model(store, "licensed", gguf, parameters={"num_parallel": 2})
    manifest = store.read_manifest("licensed")
    license_layer = Layer(MEDIA_LICENSE, *store.write_blob(b"Apache 2.0"))
    store.write_manifest("licensed", build_manifest(manifest.config, [*manifest.layers, license_layer]))
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(FakeBehaviour(answer="ok"))) as server:
        yield server, cli_env(tmp_path / "client", host=f"127.0.0.1:{server.port}")


# ---- create ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["/nonexistent", "./nope/Modelfile", "nope/Modelfile", "../nope"])
def test_create_names_a_missing_modelfile_as_given(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    expected = (1, "", f"Error: Modelfile not found: {given}\n")
    assert in_process(cli_env(tmp_path), "create", "x", "-f", given) == expected


def test_create_without_modelfile_or_model_files_says_what_is_missing(tmp_path, monkeypatch):
    folder = tmp_path / "empty"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert in_process(cli_env(tmp_path), "create", "x") == (
        1, "", "Error: no Modelfile or model files found: this folder has no Modelfile, GGUF file or Hugging Face "
               "checkpoint (name a Modelfile with -f)\n")


def test_create_without_modelfile_in_a_folder_holding_a_gguf_uses_it(tmp_path, monkeypatch):
    """As Ollama: no Modelfile means `FROM .`, which works where the folder holds the model."""
    from dgemma_cli.store import Store

    folder = tmp_path / "model"
    folder.mkdir()
    gguf = write_tiny_gguf(folder / "tiny.gguf")
    monkeypatch.chdir(folder)
    env = cli_env(tmp_path)
    code, out, err = in_process(env, "create", "x")
    assert (code, out) == (0, ""), err
    assert Store(env["DGEMMA_MODELS"]).resolve("x").gguf_path.read_bytes() == gguf.read_bytes()


# ---- the bundled model stays deleted -------------------------------------------------------------------------------

def test_rm_of_the_bundled_model_lasts_until_pull_or_run(tmp_path):
    from dgemma_cli.store import Store

    env = cli_env(tmp_path)  # nothing listens there: each command serves this store in-process
    store = Store(env["DGEMMA_MODELS"])
    assert in_process(env, "show", "sudoku")[0] == 0  # first use registers it from the package
    assert in_process(env, "rm", "sudoku") == (0, "deleted 'sudoku'\n", "")
    for _ in range(2):  # neither a look nor an unload brings it back
        assert in_process(env, "show", "sudoku") == (1, "", "Error: model 'sudoku' not found\n")
        assert in_process(env, "stop", "sudoku") == (1, "", 'Error: couldn\'t find model "sudoku" to stop\n')
    assert not store.exists("sudoku")
    assert in_process(env, "pull", "sudoku") == (0, "", "copying the bundled model from the dgemma package\nsuccess\n")
    assert in_process(env, "show", "sudoku")[0] == 0

    assert in_process(env, "rm", "sudoku")[0] == 0
    code, _, err = in_process(env, "run", "sudoku", PUZZLE, "--seed", "1")  # run pulls what the store lacks
    assert code == 0 and "copying the bundled model from the dgemma package" in err, err
    assert store.exists("sudoku")


def test_the_api_does_not_bring_back_a_deleted_bundled_model(tmp_path):
    """Through the API as through the CLI: after a delete, show and chat are 404s until a pull."""
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store

    store = Store(tmp_path / "store")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    chat = {"model": "sudoku", "messages": [{"role": "user", "content": PUZZLE}], "stream": False}
    with InProcessServer(config, store, fake_factory(FakeBehaviour(answer="ok"))) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/api/show", json={"model": "sudoku"}).status_code == 200  # first use registers it
        assert http.request("DELETE", "/api/delete", json={"model": "sudoku"}).status_code == 200
        for path, body in (("/api/show", {"model": "sudoku"}), ("/api/chat", chat)):
            answer = http.post(path, json=body)
            assert (answer.status_code, answer.json()) == (404, {"error": "model 'sudoku' not found"}), path
        assert http.post("/api/pull", json={"model": "sudoku", "stream": False}).json() == {"status": "success"}
        assert http.post("/api/show", json={"model": "sudoku"}).status_code == 200
    assert store.exists("sudoku")


# ---- stop, run ------------------------------------------------------------------------------------------------------

def test_stop_is_silent_for_a_known_model_whether_loaded_or_not(served):
    """As `ollama stop`: a model in the store is stopped or already idle (exit 0, no output); only a model the store
    does not know is an error."""
    server, env = served
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/api/generate", json={"model": "plain", "prompt": "", "keep_alive": -1}).status_code == 200
        assert [m["name"] for m in http.get("/api/ps").json()["models"]] == ["plain:latest"]
        assert in_process(env, "stop", "plain") == (0, "", "")
        assert http.get("/api/ps").json()["models"] == []
    assert in_process(env, "stop", "plain") == (0, "", "")  # not loaded
    assert in_process(env, "stop", "nosuch") == (1, "", 'Error: couldn\'t find model "nosuch" to stop\n')


def test_run_of_a_model_neither_stored_nor_pullable_says_both(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the pull fails at once, as offline
    env = {**cli_env(tmp_path), "DGEMMA_REGISTRY_MIRRORS": f"registry.ollama.ai=http://{dead}"}
    code, out, err = in_process(env, "run", "nosuchmodel", "hi")
    assert (code, out) == (1, "")
    *statuses, error = err.splitlines()
    assert statuses == ["pulling manifest"], err
    prefix = "Error: model 'nosuchmodel' not found, and pulling it failed: "
    assert error.startswith(prefix) and len(error) > len(prefix), error


# ---- help -----------------------------------------------------------------------------------------------------------

def test_serve_help_lists_the_variables_the_server_reads():
    from dgemma_cli import env

    result = dgemma_process("serve", "--help")
    assert result.returncode == 0, result.stderr
    _, _, section = result.stdout.partition("Environment variables:")
    listed = [line.split()[0] for line in section.splitlines() if line.strip().startswith("DGEMMA_")]
    assert listed == [var.name for var in env.SERVE]
    assert "DGEMMA_HOST" in listed and "DGEMMA_NOHISTORY" not in listed  # the server's, not the REPL's
    assert "(default 127.0.0.1:11435)" in " ".join(result.stdout.split())


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_convert_help_shows_every_outtype(columns):
    from dgemma_convert.quantize import OUT_TYPES

    result = dgemma_process("convert", "--help", columns=columns)
    assert result.returncode == 0, result.stderr
    words = result.stdout.replace(",", " ").split()
    assert [name for name in OUT_TYPES if name not in words] == [], result.stdout


# ---- show -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("selector, what", [("--license", "license"), ("--system", "system message"),
                                            ("--parameters", "parameters")])
def test_show_of_an_empty_field_says_so_on_stderr(served, selector, what):
    _, env = served
    assert in_process(env, "show", "plain", selector) == (0, "", f"model 'plain' has no {what}\n")


def test_show_of_a_license_prints_it(served):
    _, env = served
    assert in_process(env, "show", "licensed", "--license") == (0, "Apache 2.0\n", "")


def test_show_names_candidate_canvases_apart_from_num_parallel(served):
    _, env = served
    code, out, err = in_process(env, "show", "licensed")
    assert code == 0, err
    diffusion = out.split("  Diffusion\n")[1].split("\n\n")[0].splitlines()
    parameters = out.split("  Parameters\n")[1].split("\n\n")[0].splitlines()
    assert [row.split() for row in parameters] == [["num_parallel", "2"]]
    assert ["candidate", "canvases", "1"] in [row.split() for row in diffusion]
    assert not [row for row in diffusion if "parallel" in row], diffusion


def test_not_found_is_worded_once_as_ollama_words_it(tmp_path):
    """`run`, `show` and `rm` of a missing model all say `model 'NAME' not found`, the name as typed."""
    env = cli_env(tmp_path)
    assert in_process(env, "show", "nosuch") == (1, "", "Error: model 'nosuch' not found\n")
    assert in_process(env, "rm", "nosuch") == (1, "", "Error: model 'nosuch' not found\n")
    code, _, err = in_process(env, "run", "nosuch", "hi")
    assert code == 1 and err.splitlines()[-1].startswith("Error: model 'nosuch' not found, and pulling it failed: ")
