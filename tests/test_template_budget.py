"""Chat templates render under a time and size budget that data-dependent branches cannot escape (issue 14):
hostile templates fail with one clear line within about a second, as a 4xx through the API, and the slot is free
for the next request. Create-time and run-time checks use the same renderer."""
from __future__ import annotations

import time

import httpx
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from dgemma_engine.chat.jinja import ChatTemplateBudgetError, ChatTemplateError, render_chat
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

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
