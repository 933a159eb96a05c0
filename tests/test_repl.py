"""The interactive `dgemma run` driven in a real pseudo-terminal (pexpect) against a server with a scripted runner:
multi-line input, every slash command, Ctrl-C during a generation then another prompt, Ctrl-C on an empty line,
Ctrl-D."""
from __future__ import annotations

import re
import sys
import time

import pexpect
import pytest

from registry_server import FakeRegistry
from run_helpers import FakeBehaviour, FakeSetup, InProcessServer, fake_factory, make_store
from server_harness import REPO, SMALL_GGUF_MAX_STEPS

ANSWER = "The quick brown fox jumps over the lazy dog."
PROMPT = ">>> "


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dgemma_cli.server.config import ServerConfig

    root = tmp_path_factory.mktemp("repl-store")
    store = make_store(root / "models")
    behaviour = FakeBehaviour(answer=ANSWER, step_delay=0.002)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(root / "models")})
    with FakeRegistry() as registry, InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield FakeSetup(server, behaviour, root / "models", root, registry.url)


def spawn(setup: FakeSetup, *args: str, **env: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "run", *args], env=setup.env(TERM="xterm", **env),
                          cwd=str(REPO), encoding="utf-8", timeout=30, dimensions=(40, 120))
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, line: str, expect: str | None = None) -> str:
    """Type a line; wait for `expect` (if given) and the next prompt; return everything printed in between."""
    child.sendline(line)
    child.expect_exact(line[-20:] if line else "\n")  # readline's echo of the typed text
    if expect is not None:
        child.expect_exact(expect)
    text = child.before + (expect or "")
    child.expect_exact(PROMPT)
    return text + child.before


def test_chat_multiline_and_history(setup, tmp_path):
    b = setup.behaviour
    history = {"HOME": str(tmp_path), "DGEMMA_NOHISTORY": ""}
    child = spawn(setup, "tiny", **history)
    try:
        say(child, "hello", ANSWER)
        assert b.last_prompt[-1] == "<user>hello<assistant>"
        # `"""` opens a multi-line message that ends at a line ending in `"""`; text after the opener is kept.
        child.sendline('"""first line')
        child.expect_exact("... ")
        child.sendline("second line")
        child.expect_exact("... ")
        child.sendline('third line"""')
        child.expect_exact(ANSWER)
        child.expect_exact(PROMPT)
        assert b.last_prompt[-1] == (f"<user>hello<assistant>{ANSWER}"
                                     "<user>first line\nsecond line\nthird line<assistant>")
        say(child, "/clear", "Cleared conversation context")
        say(child, "again", ANSWER)
        assert b.last_prompt[-1] == "<user>again<assistant>"
        child.sendeof()  # Ctrl-D on an empty line
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "again" in (tmp_path / ".dgemma" / "history").read_text().splitlines()

    child = spawn(setup, "tiny", **history)  # a new session recalls the last message with the Up key
    try:
        child.send("\x1b[A")
        child.expect_exact("again")
        child.send("\r")
        child.expect_exact(ANSWER)
        child.expect_exact(PROMPT)
        assert b.last_prompt[-1] == "<user>again<assistant>"
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()


def test_set_commands(setup):
    b = setup.behaviour
    child = spawn(setup, "tiny")
    try:
        out = say(child, "/set parameter")
        for name in ("seed", "num_predict", "num_ctx", "temperature", "stop", "diffusion_steps", "diffusion_t_max",
                     "diffusion_entropy_bound", "diffusion_stability_threshold"):
            assert name in out
        say(child, "/set parameter diffusion_steps 5", "Set parameter 'diffusion_steps' to '5'")
        say(child, "/set parameter diffusion_t_max 0.7", "Set parameter 'diffusion_t_max' to '0.7'")
        say(child, "/set parameter seed 42", "Set parameter 'seed' to '42'")
        say(child, "/set parameter stop foo bar", "Set parameter 'stop' to 'foo, bar'")
        say(child, "/set parameter foo 1", "Couldn't set parameter: \"unknown parameter 'foo'\"")
        say(child, "/set parameter diffusion_steps many", "Couldn't set parameter: \"invalid int value [many]\"")
        say(child, "hi", ANSWER)
        sampler = b.last_sampler[-1]
        assert (sampler.max_steps, sampler.t_max, sampler.seed, sampler.stop) == (5, 0.7, 42, ("foo", "bar"))

        say(child, "/set system You are terse.", "Set system message.")
        say(child, "hi", ANSWER)
        assert b.last_prompt[-1].startswith("<system>You are terse.<user>hi")
        child.sendline('/set system """Line one')
        child.expect_exact("... ")
        child.sendline('line two"""')
        child.expect_exact("Set system message.")
        child.expect_exact(PROMPT)

        say(child, "/set verbose", "Set 'verbose' mode.")
        out = say(child, "hi", "denoise rate:")
        assert "eval count:" in out and "canvases:" in out
        say(child, "/set quiet", "Set 'quiet' mode.")
        assert "eval count" not in say(child, "hi", ANSWER)

        say(child, "/set think", "Set 'think' mode.")
        say(child, "hi", ANSWER)
        assert b.last_prompt[-1].endswith("<user>hi<think><assistant>")
        say(child, "/set nothink", "Set 'nothink' mode.")
        say(child, "hi", ANSWER)
        assert b.last_prompt[-1].endswith("<user>hi<assistant>")

        say(child, "/set format json", "Set format to 'json' mode.")
        say(child, "hi", ANSWER)  # the format is sent (the fake runner's scripted answer ignores it)
        say(child, "/set noformat", "Disabled format.")
        say(child, "/set format yaml", "Invalid or missing format. For 'json' mode use '/set format json'")
        for mode in ("wordwrap", "nowordwrap", "history", "nohistory", "visual", "novisual"):
            say(child, f"/set {mode}", f"Set '{mode}' mode.")
        say(child, "/set bogus", "Unknown command '/set bogus'. Type /? for help")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_show_load_save_help(setup):
    child = spawn(setup, "tiny")
    try:
        out = say(child, "/show info", "architecture")
        assert "  Model" in out
        out = say(child, "/show info", "canvas length")
        assert "  Diffusion" in out and "max denoising steps" in out
        say(child, "/show modelfile", '# Modelfile generated by "dgemma show"')
        say(child, "/show parameters", "Model defined parameters:")
        say(child, "/set parameter seed 7")
        out = say(child, "/show parameters", "User defined parameters:")
        assert re.search(r"seed {27}7", out), out
        say(child, "/show system", "No system message was specified for this model.")
        say(child, "/show template", "No prompt template was specified for this model.")
        say(child, "/show license", "No license was specified for this model.")
        say(child, "/show nonsense", "Unknown command '/show nonsense'. Type /? for help")

        say(child, "/set system Saved system.", "Set system message.")
        say(child, "hello", ANSWER)
        say(child, "/save -bad", "error: The model name '-bad' is invalid")
        say(child, "/save my-session", "Created new model 'my-session'")
        say(child, "/load no-such-model", "Couldn't find model 'no-such-model'")
        say(child, "/load my-session", "Loading model 'my-session'")
        say(child, "/show system", "Saved system.")
        out = say(child, "/show modelfile", "MESSAGE assistant")
        assert "MESSAGE user hello" in out

        say(child, "/?", "Available Commands:")
        say(child, "/help", "/? shortcuts")
        say(child, "/? set", "/set parameter ...")
        say(child, "/? show", "/show modelfile")
        say(child, "/? shortcuts", "Ctrl + d")
        say(child, "/nonsense", "Unknown command '/nonsense'. Type /? for help")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    # The saved model replays its MESSAGEs (user turns as `>>> text`), and the server puts them before new turns.
    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "run", "my-session"], env=setup.env(TERM="xterm"),
                          cwd=str(REPO), encoding="utf-8", timeout=30, dimensions=(40, 120))
    try:
        child.expect_exact(">>> hello")
        child.expect_exact(ANSWER)
        child.expect_exact(PROMPT)
        say(child, "next", ANSWER)
        assert setup.behaviour.last_prompt[-1] == f"<system>Saved system.<user>hello<assistant>{ANSWER}<user>next<assistant>"
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()


def test_ctrl_c_cancels_generation_then_prompts_again(setup):
    b = setup.behaviour
    child = spawn(setup, "tiny")
    try:
        finished = len(b.finished_at)
        b.step_delay = 0.3  # 18 steps: ~5.4 s if nothing stops it
        try:
            child.sendline("a long answer please")
            # The spinner at its second step: generation is under way and the terminal is back in its line mode
            # (a ^C typed while readline still holds the terminal arrives as text, not as an interrupt).
            child.expect_exact("denoising canvas 1 · step 2/")
            sent = time.perf_counter()
            child.sendintr()
            child.expect_exact(PROMPT, timeout=5)
            back = time.perf_counter() - sent
            deadline = time.monotonic() + 5
            while len(b.finished_at) == finished and time.monotonic() < deadline:
                time.sleep(0.05)
            # The server's generation loop ended (the cancelled turn holds no slot). How soon it notices the closed
            # connection is the server's disconnect detection, tested in test_server_api; here, after a full suite in
            # this one process, it was seen to run to its natural end (~5 s), so only the ending is asserted.
            assert len(b.finished_at) == finished + 1
        finally:
            b.step_delay = 0.002
        assert back < 2.0
        assert ANSWER not in child.before
        say(child, "and now a quick one", ANSWER)  # the cancelled turn left no trace in the conversation
        assert b.last_prompt[-1] == "<user>and now a quick one<assistant>"

        child.sendintr()  # Ctrl-C on an empty line
        child.expect_exact("Use Ctrl + d or /bye to exit.")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_visual_mode_in_the_repl(setup):
    b = setup.behaviour
    child = spawn(setup, "tiny", "--visual")
    try:
        b.step_delay = 0.1  # slower than the redraw throttle (12 frames/s): every step gets its frame
        try:
            out = say(child, "hi", ANSWER)
        finally:
            b.step_delay = 0.002
        canvases = -(-(len(ANSWER) + 1) // b.canvas_length)
        for canvas in range(1, canvases + 1):
            for step in range(1, b.steps + 1):
                assert f"canvas {canvas} · step {step}/{SMALL_GGUF_MAX_STEPS}" in out  # the model's own default
        assert out.rstrip().endswith(ANSWER)  # the live region gives way to the committed text
        child.sendline("/set novisual")
        child.expect_exact("Set 'novisual' mode.")
        child.expect_exact(PROMPT)
        out = say(child, "hi", ANSWER)
        assert "canvas 1 · step" not in out
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
