"""Unit tests of the server's pure helpers: durations, env config, option typing, stop strings, canvas budgeting."""
import math
import threading

import pytest

from dgemma_cli.errors import DgemmaError
from dgemma_cli.env import parse_size
from dgemma_cli.gotext import FOREVER, go_duration, parse_go_duration, parse_keep_alive
from dgemma_cli.hosts import parse_host
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.answers import Final, StopScanner, Text, ThinkingSplitter, plan_generation, run_generation
from dgemma_cli.server.options import GREEDY_SEED, check_options, resolve_sampler
from dgemma_cli.server.streaming import scrub_paths, timestamp
from server_harness import FakeBehaviour, FakeRunner


@pytest.mark.parametrize(
    "ns, text",
    [(3_723_500_000_000, "1h2m3.5s"), (4_230_000_000, "4.23s"), (812_300_000, "812.3ms"), (950_000, "950µs"),
     (17, "17ns"), (0, "0s"), (60_000_000_000, "1m0s"), (5_216_743_012, "5.216743012s")],
)
def test_go_duration_matches_go_examples(ns, text):
    assert go_duration(ns) == text


@pytest.mark.parametrize(
    "value, seconds",
    [(None, None), ("", None), (0, 0.0), ("0", 0.0), (30, 30.0), (1.5, 1.5), ("10m", 600.0), ("1h30m", 5400.0),
     ("300ms", 0.3), ("120", 120.0), (-1, FOREVER), ("-5m", FOREVER)],
)
def test_keep_alive_grammar(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, [], {}, "10 minutes", "m", "1x"])
def test_keep_alive_rejects_other_types(value):
    with pytest.raises(DgemmaError):
        parse_keep_alive(value)


def test_go_duration_parser_units():
    assert parse_go_duration("1h2m3.5s") == pytest.approx(3723.5)
    assert parse_go_duration("950µs") == pytest.approx(0.00095)


@pytest.mark.parametrize(
    "text, scheme, host, port",
    [("", "http", "127.0.0.1", 11435), (":11435", "http", "127.0.0.1", 11435), ("0.0.0.0", "http", "0.0.0.0", 11435),
     ("http://example.com", "http", "example.com", 80), ("https://example.com", "https", "example.com", 443),
     ("example.com:8080/path", "http", "example.com", 8080), ("[::1]:9000", "http", "::1", 9000),
     ("127.0.0.1:notaport", "http", "127.0.0.1", 11435)],
)
def test_dgemma_host_grammar(text, scheme, host, port):
    parsed = parse_host(text)
    assert (parsed.scheme, parsed.host, parsed.port) == (scheme, host, port)


def test_config_from_env_records_sources_and_ignores_ollama_vars():
    config = ServerConfig.from_env({
        "DGEMMA_MAX_QUEUE": " '8' ", "DGEMMA_KEEP_ALIVE": "-1", "DGEMMA_MAX_UPLOAD": "1MB", "OLLAMA_HOST": "0.0.0.0:1",
        "DGEMMA_NUM_PARALLEL": "zero",
    })
    assert config.max_queue == 8 and config.sources["max_queue"] == "DGEMMA_MAX_QUEUE"
    assert config.keep_alive == math.inf
    assert config.max_upload == 1_000_000
    assert config.host.port == 11435 and config.host.is_loopback
    assert config.num_parallel == 1 and any("DGEMMA_NUM_PARALLEL" in w for w in config.warnings)
    assert "api_key=unset (default)" in config.describe()
    from dgemma_cli.store import default_root  # the startup log names the store's real folder, never "None"

    assert f"models_dir={default_root()} (default)" in config.describe()


def test_parse_size_units():
    assert parse_size("128GB") == 128 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    with pytest.raises(DgemmaError):
        parse_size("lots")


def test_options_are_typed_and_unknown_ones_dropped():
    opts = check_options({"top_k": 40.0, "temperature": 1, "mirostat": 2, "tfs_z": 1.0, "stop": ["a"], "seed": None})
    assert opts == {"top_k": 40, "temperature": 1.0, "stop": ["a"]}
    for bad, kind in [({"top_k": "40"}, "integer"), ({"top_k": 1.5}, "integer"), ({"temperature": "hot"}, "float32"),
                      ({"diffusion_progress": 1}, "boolean"), ({"stop": "x"}, "array")]:
        with pytest.raises(RequestError, match=f"must be of type {kind}"):
            check_options(bad)


def test_sampler_defaults_come_from_metadata_then_reference():
    s = resolve_sampler({}, {"diffusion.eb_max_steps": 32, "diffusion.eb_t_max": 0.9}, 256)
    assert (s.max_steps, s.t_max, s.t_min, s.entropy_bound, s.stability_threshold) == (32, pytest.approx(0.9), 0.4, 0.1, 1)
    assert s.seed is None and s.num_predict == -1
    assert resolve_sampler({"seed": 0}, {}, 256).seed == 0
    zero = resolve_sampler({"temperature": 0, "seed": 5}, {}, 256)  # argmax: greedy, with valid temperatures
    assert zero.greedy and (zero.t_max, zero.t_min) == (0.8, 0.4) and zero.seed == GREEDY_SEED
    assert not resolve_sampler({"temperature": 0.7}, {}, 256).greedy
    assert resolve_sampler({"diffusion_preview": True}, {}, 256).progress


@pytest.mark.parametrize(
    "options, message",
    [({"diffusion_steps": 0}, "invalid value for diffusion_steps: 0 (must be between 1 and 256)"),
     ({"diffusion_steps": 257}, "between 1 and 256"), ({"diffusion_t_min": -0.1}, "diffusion_t_min"),
     ({"diffusion_t_max": 0.1}, "diffusion_t_max"), ({"diffusion_entropy_bound": 0}, "diffusion_entropy_bound"),
     ({"diffusion_stability_threshold": 0}, "diffusion_stability_threshold")],
)
def test_sampler_ranges(options, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_sampler(options, {}, 256)


def test_stop_scanner_holds_back_and_cuts_across_chunks():
    scanner = StopScanner(("STOP",))
    assert scanner.feed("hello ST") == ("hello", False)  # " ST" held: could start STOP
    assert scanner.feed("OP and more") == (" ", True)
    plain = StopScanner(())
    assert plain.feed("abc") == ("abc", False)


def test_thinking_splitter_routes_thought_block():
    splitter = ThinkingSplitter(True)
    parts = [splitter.feed("<|channel>thought\nlet me"), splitter.feed(" think<chan"), splitter.feed("nel|>Answer")]
    parts.append(splitter.feed("", final=True))
    assert "".join(p.thinking for p in parts) == "let me think"
    assert "".join(p.text for p in parts) == "Answer"
    assert ThinkingSplitter(False).feed("<|channel>thought x").text == "<|channel>thought x"


def _runner(**kw):
    return FakeRunner(FakeBehaviour(**kw), None, 64)


def test_plan_budgets_canvases():
    runner = _runner(canvas_length=8)
    s = resolve_sampler({"num_predict": 20}, {}, 256)
    assert plan_generation(runner, [1] * 10, s, 16).max_new_tokens == 24  # ceil(20/8) = 3 canvases
    unlimited = resolve_sampler({}, {}, 256)
    assert plan_generation(runner, [1] * 10, unlimited, 16).max_new_tokens == 48  # room: (64-10)//8 = 6
    assert plan_generation(runner, [1] * 10, unlimited, 2).max_new_tokens == 16  # DGEMMA_MAX_CANVASES
    with pytest.raises(RequestError, match=r"prompt \(60 tokens\) leaves no room for a diffusion canvas \(8 tokens\) "
                                           r"within the context window \(64 tokens\)"):
        plan_generation(runner, [1] * 60, unlimited, 16)


def _run(runner, options, prompt="p"):
    sampler = resolve_sampler(options, {}, 256)
    plan = plan_generation(runner, runner.tokenize(prompt), sampler, 16)
    return list(run_generation(runner, plan, sampler, threading.Event()))


def test_num_predict_cuts_exactly_and_reports_length():
    out = _run(_runner(answer="abcdefghijklmnopqrstuvwxyz"), {"num_predict": 11})
    assert "".join(o.text for o in out if isinstance(o, Text)) == "abcdefghijk"
    final = out[-1]
    assert isinstance(final, Final) and final.done_reason == "length" and final.metrics.eval_count == 11
    assert final.metrics.canvases == 2


def test_eos_ends_with_stop_and_counts_committed_tokens():
    out = _run(_runner(answer="hello world"), {})
    final = out[-1]
    assert final.done_reason == "stop" and final.metrics.eval_count == len("hello world")
    assert final.metrics.denoise_steps == 2 * 3 and final.metrics.canvases == 2
    assert final.context[-len("hello world"):] == _runner().tokenize("hello world")


def test_stop_string_cuts_text_and_token_count():
    out = _run(_runner(answer="alpha beta gamma delta"), {"stop": ["gamma"]})
    assert "".join(o.text for o in out if isinstance(o, Text)) == "alpha beta "
    assert out[-1].done_reason == "stop" and out[-1].metrics.eval_count == len("alpha beta ")


def test_cancelled_generation_has_no_final():
    runner = _runner(answer="x" * 40)
    sampler = resolve_sampler({}, {}, 256)
    plan = plan_generation(runner, [1000], sampler, 16)
    cancel = threading.Event()
    cancel.set()
    assert list(run_generation(runner, plan, sampler, cancel)) == []


def test_timestamps_and_path_scrubbing():
    stamp = timestamp()
    assert stamp.endswith("+00:00") and len(stamp.split(".")[1]) == len("123456+00:00")
    assert scrub_paths("cannot open /home/alice/.dgemma/models/blobs/x") == "cannot open <path>"
    assert scrub_paths("model 'hf.co/user/repo:Q4' at http://127.0.0.1:5000/v2/x") == (
        "model 'hf.co/user/repo:Q4' at http://127.0.0.1:5000/v2/x")


def test_go_template_safe_subset():
    from dgemma_engine.chat import gotemplate

    template = "{{- if .System }}<sys>{{ .System }}</sys>\n{{ end -}}<u>{{ .Prompt }}</u>\n<a>{{ .Response }}"
    text = gotemplate.render_messages(template, [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}])
    assert text == "<sys>S</sys>\n<u>hi</u>\n<a>yo<u>again</u>\n<a>"
    assert gotemplate.render_messages("{{ if .System }}A{{ else }}B{{ end }}{{ .Prompt }}",
                                      [{"role": "user", "content": "p"}]) == "Bp"
    for unsupported in ["{{ range .Messages }}x{{ end }}", "{{ .Foo }}", "{{ if .System }}x", "{{ call .X }}",
                        '{{ printf "%s" .Prompt }}', "{{ template \"x\" }}", "{{ end }}"]:
        with pytest.raises(gotemplate.UnsupportedTemplate):
            gotemplate.parse(unsupported)


def test_template_selection_order():
    from types import SimpleNamespace

    from dgemma_engine.chat.templates import select_template

    gguf = {"tokenizer.chat_template": "{{ messages }}"}
    jinja_layer = SimpleNamespace(template="{% for m in messages %}{% endfor %}", config={"template_format": "jinja"})
    go_layer = SimpleNamespace(template="{{ .Prompt }}", config={"template_format": "go"})
    bad_go = SimpleNamespace(template="{{ range .X }}{{ end }}", config={"template_format": "go"})
    assert select_template(jinja_layer, gguf).text == jinja_layer.template
    assert select_template(go_layer, gguf).text == "{{ messages }}"  # the GGUF template beats a Go layer
    assert select_template(go_layer, {}).kind == "go"
    assert select_template(bad_go, {}).kind == "none"  # unsupported Go: ignored, bare prompt
