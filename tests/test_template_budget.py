"""Chat templates render under a time and size budget that data-dependent branches cannot escape (issue 14):
hostile templates fail with one clear line within about a second, as a 4xx through the API, and the slot is free
for the next request. Create-time and run-time checks use the same renderer."""
from __future__ import annotations

import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from dgemma_engine.chat import gotemplate
from dgemma_engine.chat.budget import MAX_OUTPUT_CHARS, MAX_TEMPLATE_CHARS, MAX_TEMPLATE_DEPTH
from dgemma_engine.chat.jinja import ChatTemplateBudgetError, ChatTemplateError, render_chat
from dgemma_engine.chat.templates import check_template_source
from gguf_mutator import read, write
from server_harness import FakeBehaviour, InProcessServer, ServeProcess, add_model, fake_factory, write_small_gguf

NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "nested ranges": NESTED,
    "branch on the data": "{% if 'boom' in (messages|last).content %}" + NESTED + "{% endif %}ok",
    "doubling in a namespace (~)": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling in a namespace (+)": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                   "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "a shared list tree": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = [ns.s, ns.s] %}"
                          "{% endfor %}{{ ns.s }}",
    "percent width": "{{ '%2000000000d' % 1 }}",
    "format filter width": "{{ '%2000000000d'|format(1) }}",
    "str.format width": "{{ '{:2000000000}'.format(1) }}",
    "center filter": "{{ 'x'|center(2000000000) }}",
    "str.center": "{{ 'x'.center(2000000000) }}",
    "replace growth": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(10) %}"
                      "{% set ns.s = ns.s.replace('x', ns.s) %}{% endfor %}",
    "block set in loops": "{% for i in range(100000) %}{% set x %}{% for j in range(100000) %}"
                          "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endset %}{% endfor %}",
    "recursive loop": "{% for m in messages * 1000 recursive %}{% if loop.depth < 4 %}{{ loop(messages * 1000) }}"
                      "{% endif %}{% endfor %}",
    "loops over the content": "{% for a in (messages|last).content %}{% for b in (messages|last).content %}"
                              "{% for c in (messages|last).content %}{% endfor %}{% endfor %}{% endfor %}",
    "integer squaring": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                        "{% endfor %}{{ ns.n > 1 }}",
    "tojson indent": "{{ (messages * 100000)|tojson(indent=100000) }}",
}
MESSAGES = [{"role": "user", "content": "boom " + "y" * 2000}]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_stops_within_its_budget(name: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateBudgetError) as info:
        render_chat(HOSTILE[name], MESSAGES)
    message = str(info.value)
    assert message.startswith("chat template exceeded its ") and "budget" in message and "\n" not in message
    assert time.monotonic() - start < 2


def test_ordinary_templates_still_render() -> None:
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ '<%s>%s' % (m.role, m.content) }}{{ [m.role, ns.n]|join(':') ~ '|' }}{% endfor %}"
                "{{ '{:>5}'.format('x') }}{{ {'a': 1}|tojson }}{{ 'ab' * 2 }}{{ loop }}")
    text = render_chat(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text == "<user>hiuser:1|<assistant>yoassistant:2|    x{\"a\": 1}abab"


def test_a_big_but_plain_conversation_fits() -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 150} for i in range(20000)]
    start = time.monotonic()
    text = render_chat("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}", messages)
    assert len(text) > 3_000_000 and time.monotonic() - start < 2


# ---- through the API ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    store = Store(root / "models")
    add_model(store, "tiny", write_small_gguf(root / "tiny.gguf"), parameters={"diffusion_steps": 4})
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour())) as running:
        yield running, store


def _generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "boom", "stream": False, **body},
                      timeout=30)


@pytest.mark.parametrize("name", ["nested ranges", "branch on the data", "doubling in a namespace (~)",
                                  "percent width", "a shared list tree"])
def test_hostile_request_template_is_a_4xx_and_frees_the_slot(server, name: str) -> None:
    running, _ = server
    start = time.monotonic()
    r = _generate(running.url, template="{# messages: a Jinja template #}" + HOSTILE[name])
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("chat template exceeded its ")
    assert time.monotonic() - start < 2
    assert _generate(running.url).status_code == 200  # the slot is free again


def test_request_template_touching_a_sandboxed_attribute_is_a_400(server) -> None:
    running, _ = server
    template = "{% if 'boom' in messages[-1].content %}{{ cycler.__init__.__globals__ }}{% endif %}{{ messages }}"
    r = _generate(running.url, template=template)
    assert r.status_code == 400 and r.json()["error"].startswith("template error: SecurityError")
    assert _generate(running.url).status_code == 200


def test_create_refuses_what_every_chat_would_refuse(server) -> None:
    """The create-time check is the run-time renderer: an unsafe attribute or an over-budget loop is a 400 there."""
    running, store = server
    for template in ("{{ cycler.__init__.__globals__ }}{% for m in messages %}{% endfor %}", NESTED,
                     "{% for m in messages %}{{ '%2000000000d' % 1 }}{% endfor %}"):
        start = time.monotonic()
        r = httpx.post(running.url + "/api/create", json={"model": "bad", "from": "tiny", "template": template,
                                                          "stream": False}, timeout=30)
        assert r.status_code == 400 and r.json()["error"].startswith("template error: "), r.text
        assert "\n" not in r.json()["error"] and time.monotonic() - start < 2
        assert not store.exists("bad")


def test_runtime_and_create_errors_name_the_same_budget() -> None:
    from dgemma_cli.create import CreateError, check_jinja_template

    # 2,000,000 steps take about half of the 1 s deadline on a quiet machine: under load the deadline trips first
    with pytest.raises(CreateError, match="^template error: chat template exceeded its (step|time) budget"):
        check_jinja_template(NESTED)
    with pytest.raises(ChatTemplateError, match="^chat template exceeded its (step|time) budget"):
        render_chat(NESTED, MESSAGES)


# ---- the limits of both kinds of template: source size, nesting, output (issue 36) ----------------------------------

CHAT = [{"role": "user", "content": "a"}]
DEEP = 5000
TOO_DEEP = f"chat template is nested more than {MAX_TEMPLATE_DEPTH} levels deep"
# Each of jinja2's recursive paths (blocks; brackets and operands; `not`, `-` and `else` chains) and each chain its
# parser builds in a loop but its code generator recurses over (operators, filters, attributes, calls), 5,000 deep.
# (Within the size limit, so that the nesting is what is refused.)
DEEP_JINJA = {
    "ifs": "{%if messages%}" * DEEP + "x" + "{%endif%}" * DEEP,
    "fors in an if": "{%if messages%}" + "{%for m in messages%}" * 3000 + "{%endfor%}" * 3000 + "{%endif%}",
    "brackets": "{{ messages and " + "(" * DEEP + "1" + ")" * DEEP + " }}",
    "lists": "{{ messages and " + "[" * DEEP + "]" * DEEP + " }}",
    "not": "{{ " + "not " * DEEP + "messages }}",
    "unary minus": "{{ messages and " + "-" * DEEP + "1 }}",
    "else chain": "{{ messages and " + "1 if messages else " * DEEP + "2 }}",
    "operator chain": "{{ messages and " + " + ".join(["1"] * DEEP) + " }}",
    "filter chain": "{{ messages" + "|first" * DEEP + " }}",
    "attribute chain": "{{ messages" + ".a" * DEEP + " }}",
    "macro calls": "{% macro f() %}{% endmacro %}{{ messages and f" + "()" * DEEP + " }}",
}


def _one_line_within(error: BaseException, started: float, seconds: float = 3.0) -> str:
    message = str(error)
    assert "\n" not in message and time.monotonic() - started < seconds, (message, time.monotonic() - started)
    return message


@pytest.mark.parametrize("kind,template", [
    ("go", "{{ .Prompt }}" + "x" * 30_000_000),
    ("jinja", "{% for m in messages %}{{ m.content }}{% endfor %}" + "x" * 30_000_000),
])
def test_a_template_over_the_size_limit_is_refused_before_it_is_parsed(kind: str, template: str) -> None:
    expected = f"chat template is {len(template)} characters long (at most {MAX_TEMPLATE_CHARS})"
    render = gotemplate.render_messages if kind == "go" else render_chat
    for attempt in (lambda: check_template_source(template), lambda: render(template, CHAT)):
        start = time.monotonic()
        with pytest.raises(ChatTemplateBudgetError) as info:
            attempt()
        assert _one_line_within(info.value, start, 1.0) == expected
    check_template_source(template[:MAX_TEMPLATE_CHARS])  # at the limit: accepted


@pytest.mark.parametrize("name", sorted(DEEP_JINJA))
def test_deep_jinja_nesting_is_a_budget_error_not_a_recursion_error(name: str) -> None:
    assert len(DEEP_JINJA[name]) <= MAX_TEMPLATE_CHARS
    for attempt in (lambda: render_chat(DEEP_JINJA[name], CHAT), lambda: check_template_source(DEEP_JINJA[name])):
        start = time.monotonic()
        with pytest.raises(ChatTemplateBudgetError) as info:
            attempt()
        assert _one_line_within(info.value, start) == TOO_DEEP


def test_deep_go_nesting_is_a_budget_error_not_a_recursion_error() -> None:
    deep = "{{ if .Prompt }}" * DEEP + "{{ .Prompt }}" + "{{ end }}" * DEEP
    unsupported = "{{range .Messages}}" * DEEP + "{{end}}" * DEEP  # kept verbatim if shallow, never rendered
    assert len(deep) <= MAX_TEMPLATE_CHARS and len(unsupported) <= MAX_TEMPLATE_CHARS
    for attempt in (lambda: gotemplate.render_messages(deep, CHAT), lambda: check_template_source(deep),
                    lambda: check_template_source(unsupported)):
        start = time.monotonic()
        with pytest.raises(ChatTemplateBudgetError) as info:
            attempt()
        assert _one_line_within(info.value, start) == TOO_DEEP
    check_template_source("{{ range .Messages }}{{ end }}")  # outside the subset but within the limits: stored
    at_limit = "{{ if .Prompt }}" * MAX_TEMPLATE_DEPTH + "{{ .Prompt }}" + "{{ end }}" * MAX_TEMPLATE_DEPTH
    assert gotemplate.render_messages(at_limit, CHAT) == "a"


def test_nesting_real_templates_use_still_renders() -> None:
    """The deepest real chat templates nest 29 levels (syntax tree); well within the limit renders as before."""
    template = ("{% for m in messages %}" + "{% if m.content %}" * 40 + "{{ (((m.content|upper) ~ '!')) }}"
                + "{% endif %}" * 40 + "{% endfor %}")
    assert render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "A!B!"


def test_what_python_cannot_compile_is_a_budget_error() -> None:
    """jinja2 turns each `for` into a Python loop and Python allows 20 nested blocks: a one-line 400, not a
    SyntaxError escaping as a 500."""
    template = "{% for m in messages %}" * 30 + "x" + "{% endfor %}" * 30
    with pytest.raises(ChatTemplateBudgetError, match=r"^chat template is too complex to compile \(too many "):
        render_chat(template, CHAT)


def test_go_output_is_counted_while_it_is_rendered() -> None:
    """1,000 turns through a 100,000-character template would be 100 million characters: the render stops at the
    output budget, having held little more than the budget."""
    template = "{{ .Prompt }}" + "x" * 100_000
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 1000
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ChatTemplateBudgetError) as info:
            gotemplate.render_messages(template, messages)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _one_line_within(info.value, start, 2.0) == f"chat template output exceeds {MAX_OUTPUT_CHARS} characters"
    assert peak < 3 * MAX_OUTPUT_CHARS, peak


def test_jinja_output_has_the_same_budget() -> None:
    messages = [{"role": "user", "content": "x" * 100_000}] * 50
    with pytest.raises(ChatTemplateBudgetError, match=f"^chat template output exceeds {MAX_OUTPUT_CHARS} characters$"):
        render_chat("{% for m in messages %}{{ m.content }}{% endfor %}", messages)


# through the API: a per-request `template` and /api/create

@pytest.mark.parametrize("name,template,expected", [
    ("30 MB Go", "{{ .Prompt }}" + "x" * 30_000_000, "chat template is 30000013 characters long"),
    ("30 MB Jinja", "{{ messages }}" + "x" * 30_000_000, "chat template is 30000014 characters long"),
    ("Go nested 5,000 deep", "{{ if .Prompt }}" * DEEP + "{{ .Prompt }}" + "{{ end }}" * DEEP, TOO_DEEP),
    ("Jinja nested 5,000 deep", DEEP_JINJA["ifs"], TOO_DEEP),
    ("Jinja brackets 5,000 deep", DEEP_JINJA["brackets"], TOO_DEEP),
])
def test_hostile_request_template_limits_are_a_400(server, name: str, template: str, expected: str) -> None:
    running, _ = server
    start = time.monotonic()
    r = _generate(running.url, template=template)
    assert r.status_code == 400 and r.json()["error"].startswith(expected), (r.status_code, r.text[:300])
    assert time.monotonic() - start < 5
    assert _generate(running.url).status_code == 200


@pytest.mark.parametrize("name,template,expected", [
    ("1 MB Go", "{{ .Prompt }}" + "x" * 1_000_000, "chat template is 1000013 characters long"),
    ("Go nested 5,000 deep", "{{ if .Prompt }}" * DEEP + "{{ end }}" * DEEP, TOO_DEEP),
    ("Jinja nested 5,000 deep", "{% for m in messages %}" + DEEP_JINJA["ifs"] + "{% endfor %}", TOO_DEEP),
])
def test_create_refuses_a_template_over_the_limits(server, name: str, template: str, expected: str) -> None:
    running, store = server
    r = httpx.post(running.url + "/api/create", json={"model": "limits", "from": "tiny", "template": template,
                                                      "stream": False}, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith(expected), (r.status_code, r.text[:300])
    assert not store.exists("limits")


# through `dgemma serve` with the engine: a Go TEMPLATE a store holds from before the limits

def _without_chat_template(source: Path, out: Path) -> Path:
    """The fixture GGUF without `tokenizer.chat_template`, so that a stored Go TEMPLATE is what chats render with."""
    kvs, tensors = read(source)
    return write(out, [kv for kv in kvs if kv.key != "tokenizer.chat_template"], tensors)


def _store_go_model(store: Store, name: str, gguf: Path, template: str) -> None:
    """A model whose Go TEMPLATE never met create's checks (as one stored before them, or written by another tool)."""
    from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_TEMPLATE, Layer, build_manifest,
                                  canonical_json)

    digest, size, _ = store.import_file(gguf)
    layers = [Layer(MEDIA_MODEL, digest, size), Layer(MEDIA_TEMPLATE, *store.write_blob(template.encode()))]
    config = {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"],
              "template_format": "go"}
    config_digest, config_size = store.write_blob(canonical_json(config))
    store.write_manifest(name, build_manifest(Layer(CONFIG_MEDIA_TYPE, config_digest, config_size), layers))


def _rss_mb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise AssertionError(field)


def _post_watched(process, url: str, body: dict, limit_mb: int) -> tuple[httpx.Response | None, int]:
    """The answer and the server's peak RSS while it came; the server is killed (and the answer None) past
    `limit_mb`, so that a regression fails this test instead of exhausting the machine."""
    Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # VmHWM from now on
    result: list[httpx.Response | None] = [None]

    def send() -> None:
        try:
            result[0] = httpx.post(url, json=body, timeout=120)
        except httpx.HTTPError:
            pass

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        if _rss_mb(process.pid) > limit_mb:
            process.kill()
            sender.join()
            return None, limit_mb
        time.sleep(0.02)
    return result[0], _rss_mb(process.pid, "VmHWM")


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("budget-engine")
    gguf = _without_chat_template(gguf_path("tiny-a", "f32"), root / "tiny-a-no-template.gguf")
    store = Store(root / "models")
    _store_go_model(store, "go-1mb", gguf, "{{ .Prompt }}" + "x" * 1_000_000)
    _store_go_model(store, "go-100k", gguf, "{{ .Prompt }}" + "x" * 100_000)
    with ServeProcess(store.root, {"DGEMMA_NOPRUNE": "1"}) as running:
        yield running


@pytest.mark.parametrize("model,status", [("go-1mb", 200), ("go-100k", 400)])
def test_a_stored_go_template_and_fifty_messages_stay_bounded(engine_server, model: str, status: int) -> None:
    """50 one-letter messages through a stored Go template: one over the size limit is ignored (logged, the bare
    prompt), one within it stops at the output budget (50 turns of 100,000 characters): either way within seconds,
    and the server's memory stays where it was."""
    options = {"num_predict": 8, "diffusion_steps": 2, "seed": 1}
    body = {"model": model, "stream": False, "options": options, "messages": [{"role": "user", "content": "a"}] * 50}
    url = engine_server.url + "/api/chat"
    assert httpx.post(url, json={**body, "messages": CHAT}, timeout=60).status_code in (200, 400)  # loaded
    before = _rss_mb(engine_server.process.pid)
    start = time.monotonic()
    r, peak = _post_watched(engine_server.process, url, body, limit_mb=before + 1500)
    assert r is not None, f"the server went past {before + 1500} MB"
    assert r.status_code == status and time.monotonic() - start < 10, (r.status_code, r.text[:300])
    if status == 400:
        assert r.json()["error"] == f"chat template output exceeds {MAX_OUTPUT_CHARS} characters"
    else:
        assert "ignoring the model's Go template: chat template is 1000013 characters long" in engine_server.logs()
    assert peak - before < 300 and _rss_mb(engine_server.process.pid) - before < 100, (before, peak)
