"""`dgemma pull|create|list|show|rm|cp` as clients of the REST API (docs/compat.md#cli-surface): against a running
server they touch only that server's store (create uploads its GGUF through /api/blobs, HEAD first); with nothing
listening they serve the API in-process for their own duration. Errors are the server's text on one line."""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from cli_helpers import cli_env, in_process
from dgemma_cli import store_client, wire
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf
from store_helpers import write_tiny_gguf

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def served(tmp_path):
    """A running server (scripted runner) over its own store holding `served` and `llama3` (another family)."""
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store

    store = Store(tmp_path / "server-store")
    gguf = write_small_gguf(tmp_path / "small.gguf")
    add_model(store, "served", gguf, system="From the server.")
    add_model(store, "llama3", gguf, family="llama")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(FakeBehaviour(answer="ok"))) as server:
        yield server, store


def layer_digests(store, name: str) -> list[str]:
    return [layer.digest for layer in store.read_manifest(name).layers]


def test_commands_work_on_the_running_servers_store(served, tmp_path):
    server, store = served
    env = cli_env(tmp_path / "client", host=f"127.0.0.1:{server.port}")  # the client's own store stays unused
    code, out, _ = in_process(env, "list")
    assert code == 0 and sorted(line.split()[0] for line in out.splitlines()[1:]) == ["llama3:latest", "served:latest"]
    assert in_process(env, "show", "served", "--system") == (0, "From the server.\n", "")

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nSYSTEM mine\n")
    code, out, err = in_process(env, "create", "mine", "-f", str(tmp_path / "Modelfile"))
    assert (code, out) == (0, ""), err
    model = store.resolve("mine")
    assert model.system == "mine" and model.gguf_path.read_bytes() == gguf.read_bytes()
    digest = model.manifest.layers[0].digest
    assert f"copying file {digest[7:19]}: 100% " in err and err.rstrip().endswith("success")

    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nSYSTEM again\n")
    code, _, err = in_process(env, "create", "again", "-f", str(tmp_path / "Modelfile"))
    assert code == 0 and "copying file" not in err  # HEAD /api/blobs found the blob: nothing uploaded twice
    assert layer_digests(store, "again")[0] == digest

    assert in_process(env, "cp", "mine", "other/copy:v1") == (0, "copied 'mine' to 'other/copy:v1'\n", "")
    assert store.read_manifest("other/copy:v1").raw == store.read_manifest("mine").raw
    assert not (tmp_path / "client" / "store").exists()


def test_rm_unloads_then_deletes(served, tmp_path):
    server, store = served
    env = cli_env(tmp_path, host=f"127.0.0.1:{server.port}")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/api/generate", json={"model": "served", "prompt": "", "keep_alive": -1}).status_code == 200
        assert [m["name"] for m in http.get("/api/ps").json()["models"]] == ["served:latest"]
        assert in_process(env, "rm", "served") == (0, "deleted 'served'\n", "")
        assert http.get("/api/ps").json()["models"] == []
    assert not store.exists("served")
    # An unload the server refuses (another architecture) is a warning; the delete still happens.
    assert in_process(env, "rm", "llama3") == (0, "deleted 'llama3'\n", "Warning: unable to stop model 'llama3'\n")
    assert in_process(env, "rm", "served") == (1, "", "Error: model 'served' not found\n")


def test_create_from_a_checkpoint_folder_converts_locally_then_uploads(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    env = cli_env(tmp_path)  # nothing listens there: served in-process
    (tmp_path / "Modelfile").write_text(f"FROM {FIXTURES / 'tiny-a'}\nPARAMETER diffusion_steps 4\n")
    code, out, err = in_process(env, "create", "tiny-a", "-f", str(tmp_path / "Modelfile"), "-q", "q8_0")
    assert (code, out) == (0, ""), err
    assert err.splitlines()[:2] == ["gathering model components", "converting model"]
    assert "copying file " in err and not any((tmp_path / "tmp").iterdir())  # temporary GGUF removed
    assert not [t for t in threading.enumerate() if t.name == "dgemma-local-server"]  # no server left behind

    code, out, _ = in_process(env, "show", "tiny-a")
    assert code == 0 and "    quantization        Q8_0\n" in out and "    max denoising steps     4\n" in out


def test_show_modelfile_output_recreates_identical_layers(tmp_path):
    """The round trip of docs/compat.md#round-trip through the CLI: `show --modelfile` then `create -f` gives the same
    layers."""
    from dgemma_cli.store import Store

    env = cli_env(tmp_path)
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "Modelfile").write_text('FROM ./tiny.gguf\nSYSTEM """multi\nline"""\nPARAMETER stop a\n'
                                        'PARAMETER stop "b c"\nPARAMETER diffusion_t_max 1.1\nLICENSE L1\nLICENSE L2\n'
                                        "MESSAGE user q\nMESSAGE assistant r\n")
    assert in_process(env, "create", "orig", "-f", str(tmp_path / "Modelfile"))[0] == 0
    code, text, _ = in_process(env, "show", "orig", "--modelfile")
    (tmp_path / "Shown").write_text(text)
    with pytest.MonkeyPatch.context() as patch:  # FROM is the server's blob path: its name is its digest, no rehash
        patch.setattr(store_client, "_sha256_file", lambda path: pytest.fail(f"hashed {path}"))
        code, _, err = in_process(env, "create", "again", "-f", str(tmp_path / "Shown"))
    assert code == 0, err
    store = Store(tmp_path / "store")
    assert layer_digests(store, "again") == layer_digests(store, "orig")


@pytest.mark.parametrize("setup,args,message", [
    # the server's quantize check (the flag reaches it)
    ("quantized", ("-q", "q4_K_M"), "quantization is only supported from F32, F16 or BF16 models"),
    # refused locally before any upload, with the server's wording
    ("text", (), "supplied file was not in GGUF format (invalid GGUF: bad magic"),
    ("llama", (), 'model architecture "llama" is not supported by dgemma'),
    ("adapter", (), "invalid adapter adapter.gguf: not a LoRA adapter: the GGUF is a model"),
])
def test_create_errors_are_one_line_and_leave_no_model(tmp_path, setup, args, message):
    from dgemma_cli.store import Store

    env = cli_env(tmp_path)
    write_tiny_gguf(tmp_path / "quantized.gguf", file_type=7)  # claims Q8_0
    write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    write_tiny_gguf(tmp_path / "adapter.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    modelfile = f"FROM ./{setup}.gguf\n" + ("ADAPTER ./adapter.gguf\n" if setup == "adapter" else "")
    (tmp_path / "Modelfile").write_text(modelfile)
    code, out, err = in_process(env, "create", "m", "-f", str(tmp_path / "Modelfile"), *args)
    assert (code, out) == (1, "") and err.splitlines()[-1].startswith(f"Error: {message}"), err
    assert not Store(tmp_path / "store").list_models()
    blobs = tmp_path / "store" / "blobs"
    uploaded = sorted(p.name for p in blobs.iterdir()) if blobs.exists() else []
    assert len(uploaded) == (1 if setup == "quantized" else 0)  # only a file the server had to see was sent


def test_a_server_that_drops_the_connection_is_a_one_line_error(tmp_path):
    """`HEAD /` answers, then every request is dropped unanswered: no traceback, one `Error:` line."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Flaky(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.end_headers()

        def do_GET(self):
            self.close_connection = True  # no status line at all

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Flaky) as flaky:
        thread = threading.Thread(target=flaky.serve_forever, daemon=True)
        thread.start()
        try:
            code, out, err = in_process(cli_env(tmp_path, host=f"127.0.0.1:{flaky.server_address[1]}"), "list")
        finally:
            flaky.shutdown()
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert err.startswith("Error: lost the connection to the dgemma server (")


def test_parameter_rows_read_the_servers_text():
    """Rows from `/api/show` `parameters` as the server writes them, including a key that fills all 30 columns."""
    from dgemma_cli.cmd_store import parameter_rows
    from dgemma_cli.server.model_info import format_parameters

    text = format_parameters({"diffusion_confidence_threshold": 0.01, "stop": ["a b", "<end>"], "seed": 7})
    assert parameter_rows(text) == [("diffusion_confidence_threshold", "0.01"), ("seed", "7"), ("stop", '"a b"'),
                                    ("stop", '"<end>"')]


def test_create_request_for_a_model_name_sends_no_files(tmp_path):
    """FROM a model name: nothing is uploaded; the Modelfile's values travel as typed /api/create fields."""
    from dgemma_cli.modelfile import parse_modelfile

    modelfile = parse_modelfile('FROM base:v2\nSYSTEM ""\nPARAMETER stop a\nPARAMETER seed 3\nRENDERER r1\n'
                                "MESSAGE user hi\nLICENSE L\n")
    body = wire.request_body(store_client.create_request(None, "m", modelfile, tmp_path, "q8_0", progress=[].append))
    assert body == {"model": "m", "from": "base:v2", "quantize": "q8_0", "system": "", "license": ["L"],
                    "parameters": {"stop": ["a"], "seed": 3}, "messages": [{"role": "user", "content": "hi"}],
                    "renderer": "r1"}


def test_rm_of_an_invalid_name_is_one_error_line(served, tmp_path):
    server, _ = served
    env = cli_env(tmp_path, host=f"127.0.0.1:{server.port}")
    assert in_process(env, "rm", "Bad Name!") == (1, "", "Error: invalid model name\n")
