"""`dgemma run`, `ps`, `stop` as subprocesses against a server with a scripted runner (fast, deterministic): one-shot
with arguments and piped stdin, `--verbose` labels, auto-pull, and every error path as one `Error: ...` line."""
from __future__ import annotations

import re

import pytest

from registry_server import FakeRegistry
from run_helpers import TIMING_LABELS, FakeBehaviour, FakeSetup, InProcessServer, fake_factory, make_store, run_cli
from server_harness import write_small_gguf

ANSWER = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import MEDIA_MODEL

    root = tmp_path_factory.mktemp("run-store")
    store = make_store(root / "models")
    behaviour = FakeBehaviour(answer=ANSWER, step_delay=0.002)  # timings well above 1 ms
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(root / "models")})
    with FakeRegistry() as registry, pytest.MonkeyPatch.context() as patch:
        # The pull runs inside the server, in this process: point the default registry at the fake one.
        patch.setenv("DGEMMA_REGISTRY_MIRRORS", f"registry.ollama.ai={registry.url}")
        patch.setenv("DGEMMA_REGISTRY_ALLOW", registry.host)
        gguf = write_small_gguf(root / "pullable.gguf").read_bytes()
        registry.add_model("library/pullable:latest", [(MEDIA_MODEL, gguf)],
                           config={"model_format": "gguf", "model_family": "diffusion-gemma"})
        with InProcessServer(config, store, fake_factory(behaviour)) as server:
            yield FakeSetup(server, behaviour, root / "models", root, registry.url)


def assert_one_line_error(result, text: str) -> None:
    assert result.returncode == 1, result
    assert result.stderr.strip().splitlines() == [f"Error: {text}"], result.stderr
    assert "Traceback" not in result.stderr


def test_one_shot_prompt_arguments(setup):
    before = setup.behaviour.generations
    result = run_cli(["run", "tiny", "say", "the", "sentence"], setup.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"  # not a terminal: no spinner, no colours, no wrapping
    assert result.stderr == ""
    assert setup.behaviour.generations == before + 1
    assert setup.behaviour.last_prompt[-1] == "<user>say the sentence<assistant>"


def test_one_shot_piped_stdin_is_prepended(setup):
    result = run_cli(["run", "tiny", "and", "arguments"], setup.env(), stdin="text from stdin\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    assert setup.behaviour.last_prompt[-1] == "<user>text from stdin and arguments<assistant>"


def test_piped_stdin_alone_runs_non_interactively(setup):
    result = run_cli(["run", "tiny", "--visual"], setup.env(), stdin="only stdin")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"  # --visual off a terminal: plain streaming
    assert setup.behaviour.last_prompt[-1] == "<user>only stdin<assistant>"
    assert not setup.behaviour.last_sampler[-1].progress  # no per-step chunks were even requested


def test_empty_prompt_only_loads(setup):
    before = setup.behaviour.generations
    result = run_cli(["run", "tiny", ""], setup.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert setup.behaviour.generations == before


def test_sampler_flags_reach_the_sampler(setup):
    result = run_cli(["run", "tiny", "hi", "--steps", "7", "--t-max", "0.9", "--t-min", "0.3", "--entropy-bound", "0.2",
                      "--confidence-threshold", "0.01", "--stability-threshold", "2", "--seed", "5"], setup.env())
    assert result.returncode == 0, result.stderr
    sampler = setup.behaviour.last_sampler[-1]
    assert (sampler.max_steps, sampler.t_max, sampler.t_min, sampler.entropy_bound, sampler.confidence_threshold,
            sampler.stability_threshold, sampler.seed) == (7, 0.9, 0.3, 0.2, 0.01, 2, 5)


def test_verbose_prints_ollama_timing_block(setup):
    result = run_cli(["run", "tiny", "hi", "--verbose"], setup.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0] == f"using the dgemma server at http://127.0.0.1:{setup.server.port}"
    block = lines[1:]
    labels = [line[:22].rstrip().rstrip(":") for line in block]
    assert labels == [label for label in TIMING_LABELS if label in labels]  # Ollama's order
    assert set(TIMING_LABELS) - set(labels) <= {"load duration"}  # zero values are omitted: the model was resident
    for line in block:
        assert line[21] == " " and line[22] != " ", line  # values start at column 23
    values = {line[:22].rstrip().rstrip(":"): line[22:] for line in block}
    assert re.fullmatch(r"[0-9.]+(ns|µs|ms|s)|[0-9]+m[0-9.]+s", values["total duration"])
    assert values["eval count"] == f"{len(ANSWER)} token(s)"
    assert re.fullmatch(r"\d+\.\d\d tokens/s", values["eval rate"])
    canvases = -(-(len(ANSWER) + 1) // setup.behaviour.canvas_length)  # answer + EOS in 8-token canvases
    assert values["canvases"] == str(canvases)
    assert values["denoise steps"] == str(canvases * setup.behaviour.steps)
    assert values["steps per canvas"] == f"{setup.behaviour.steps:.2f}"
    assert re.fullmatch(r"\d+\.\d\d steps/s", values["denoise rate"])


def test_think_flag_values(setup):
    result = run_cli(["run", "tiny", "--think", "hello"], setup.env())  # bare --think: `hello` stays the prompt
    assert result.returncode == 0, result.stderr
    assert setup.behaviour.last_prompt[-1] == "<user>hello<think><assistant>"
    assert_one_line_error(run_cli(["run", "tiny", "--think=maybe", "hi"], setup.env()),
                          'invalid value for --think: "maybe" (must be true, false, high, medium, low, or max)')


def test_auto_pull_then_run(setup):
    result = run_cli(["run", "pullable", "hi"], setup.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    assert "pulling manifest" in result.stderr and "success" in result.stderr


def test_error_unknown_model(setup):
    """As `ollama run`: not in the store, so it is pulled, and the registry does not know it."""
    result = run_cli(["run", "no-such-model", "hi"], setup.env())
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["pulling manifest", "Error: model 'no-such-model' not found, and "
                                          "pulling it failed: pull model manifest: file does not exist"]
    assert result.stdout == ""


def test_error_not_a_diffusion_model(setup):
    assert_one_line_error(run_cli(["run", "llama3", "hi"], setup.env()),
                          'model architecture "llama" is not supported by dgemma')


def test_error_unreadable_gguf(setup):
    result = run_cli(["run", "broken", "hi"], setup.env())
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: ") and "gguf" in line.lower(), line
    assert str(setup.store_dir) not in line  # no server paths leak


def test_prompt_longer_than_context_is_truncated(setup):
    """As `ollama run`: an over-long prompt keeps its end (the server truncates) and is answered."""
    result = run_cli(["run", "small-ctx", "a prompt that does not fit"], setup.env())
    assert result.returncode == 0 and result.stdout.strip() and not result.stderr.strip(), result


def test_error_invalid_model_name(setup):
    assert_one_line_error(run_cli(["run", "bad..//name", "hi"], setup.env()), "invalid model name")


def test_error_server_rejects_option(setup):
    assert_one_line_error(run_cli(["run", "tiny", "hi", "--steps", "0"], setup.env()),
                          "invalid value for diffusion_steps: 0 (must be between 1 and 256)")


def test_ps_and_stop(setup):
    assert run_cli(["run", "tiny", "", "--keepalive", "10m"], setup.env()).returncode == 0
    result = run_cli(["ps"], setup.env())
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    (row,) = [row for row in rows if row.startswith("tiny:latest ")]
    assert "100% CPU" in row and re.search(r"(9|10) minutes from now$", row), row  # --keepalive reached the server
    assert run_cli(["stop", "tiny"], setup.env()).returncode == 0
    assert_one_line_error(run_cli(["stop", "no-such-model"], setup.env()), 'couldn\'t find model "no-such-model" to stop')


def test_no_server_starts_one_in_process(setup, tmp_path):
    """Nothing listens at DGEMMA_HOST: the command serves the store itself and exits (no daemon left behind)."""
    from server_harness import free_port

    env = setup.env(DGEMMA_HOST=f"127.0.0.1:{free_port()}")
    result = run_cli(["ps"], env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    # an empty table alone reads as "nothing loaded" when the truth is "no server": say so, once
    assert result.stderr.splitlines() == [f"no dgemma server at http://{env['DGEMMA_HOST']}: nothing stays loaded "
                                          "without `dgemma serve`"]
    result = run_cli(["run", "broken", "hi", "--verbose"], env)  # the real engine's server, in-process
    assert result.returncode == 1
    first, error = result.stderr.strip().splitlines()  # no server log lines, no traceback
    assert first.startswith("no dgemma server at http://127.0.0.1:") and "started one in-process" in first
    assert error.startswith("Error: ") and "gguf" in error.lower(), error


THOUGHT_ANSWER = "<|channel>thought\nLet me think.<channel|>The answer."


def test_thinking_shown_then_hidden(setup):
    b = setup.behaviour
    b.answer = THOUGHT_ANSWER
    try:
        shown = run_cli(["run", "tiny", "--think", "hi"], setup.env())
        hidden = run_cli(["run", "tiny", "--think", "--hidethinking", "hi"], setup.env())
    finally:
        b.answer = ANSWER
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "Thinking...\nLet me think.\n...done thinking.\n\nThe answer.\n"  # no colours off-terminal
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout == "The answer.\n"


class DyingServer:
    """A raw HTTP server that answers the probe and `/api/show`, then cuts a generation stream after one line."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        import json

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(4096)
                    if not data:
                        break
                    head += data
                header, _, body = head.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", header).group(1)) if b"ength:" in header else 0
                while len(body) < length:
                    body += conn.recv(4096)
                if header.startswith(b"HEAD"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                elif b"/api/show" in header.split(b"\r\n")[0]:
                    payload = json.dumps({"model_info": {"general.architecture": "diffusion-gemma"}}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
                else:
                    line = b'{"response":"partial","done":false}\n'
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(line), line))
                    # ... and the server dies mid-stream: no terminating chunk

    def close(self):
        self.sock.close()


def test_error_server_dies_mid_stream(setup):
    server = DyingServer()
    try:
        result = run_cli(["run", "m", "hi"], setup.env(DGEMMA_HOST=f"127.0.0.1:{server.port}"))
    finally:
        server.close()
    assert result.returncode == 1
    assert result.stdout == "partial\n"  # what arrived is kept, on its own line
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: lost the connection to the dgemma server at http://127.0.0.1:{server.port}"), line
