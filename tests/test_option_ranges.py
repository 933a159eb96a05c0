"""Every option and PARAMETER has a range from the one options table (dgemma_engine.settings.OPTION_SETTINGS), checked
at create (REST `parameters`, Modelfile PARAMETERs), at pull (tests/test_pull.py) and per request; and REST create
checks what a Modelfile checks, so `show --modelfile` always prints a Modelfile that create accepts (issue 36, items
1 and 14).

The crash itself needs the real engine: `num_thread 1000` on a non-F32 model overflowed the soft-embedding graph
(GGML_ASSERT, the process aborted), and a model stored with it crashed every later server too."""
from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest

from dgemma_cli.create import create_model
from dgemma_cli.modelfile import Modelfile, ModelfileError, check_parameters, checked_modelfile, parse_modelfile
from dgemma_cli.server import options as server_options
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError
from dgemma_cli.store import MEDIA_MODEL, Store
from dgemma_engine import settings
from server_harness import FakeBehaviour, InProcessServer, ServeProcess, add_model, fake_factory, write_small_gguf

RANGED = [row for row in settings.OPTION_SETTINGS if row.type in (int, float) and row.bounds() != (None, None)]


def test_num_thread_is_bounded_by_the_cores_and_the_engine():
    assert settings.max_threads() == min(settings.THREADS_PER_CORE * settings.usable_cores(), settings.MAX_THREADS)
    assert settings.option_setting("num_thread").bounds() == (0, settings.max_threads())
    with pytest.raises(ModelfileError, match=rf"^invalid value for num_thread: 1000 \(must be between 0 and "
                                             rf"{settings.max_threads()}\)$"):
        check_parameters({"num_thread": 1000})


@pytest.mark.parametrize("row", RANGED, ids=lambda row: row.name)
def test_every_load_time_range_is_checked_at_create_and_per_request(row):
    low, high = row.bounds()
    for good in (low, high):
        assert check_parameters({row.name: good}) == {row.name: good}
        if row.request:
            assert server_options.check_options({row.name: good}) == {row.name: good}
    for bad in (low - 1, high + 1):
        message = f"invalid value for {row.name}: {bad} (must be between {low} and {high})"
        with pytest.raises(ModelfileError) as exc:
            checked_modelfile(Modelfile(froms=["m"], parameters={row.name: bad}))
        assert str(exc.value) == message
        modelfile = parse_modelfile(f"FROM m\nPARAMETER {row.name} {bad}\n")  # the grammar types, create ranges
        with pytest.raises(ModelfileError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
            checked_modelfile(modelfile)
        if row.request:
            with pytest.raises(RequestError) as exc:
                server_options.check_options({row.name: bad})
            assert str(exc.value) == message
        with pytest.raises(RequestError) as exc:  # a model stored with it: refused per request, before any load
            server_options.decode_options({row.name: bad}, None, {}, 4096, 256)
        assert str(exc.value) == f"the model's parameters are invalid: {message}"


def test_the_runner_refuses_an_unchecked_thread_count_before_loading(tmp_path):
    from dgemma_cli.server.runner import EngineRunner

    model = SimpleNamespace(name="thr", gguf_path=write_small_gguf(tmp_path / "m.gguf"),
                            parameters={"num_thread": 1000}, adapters=[], projector=None)
    with pytest.raises(RequestError, match=r"invalid value for num_thread: 1000"):
        EngineRunner(model, 64)
    assert server_options.load_options({"num_thread": 0, "num_gpu": -1}) == server_options.LoadOptions(None, -1, 0)
    assert server_options.load_options({"num_thread": 2, "num_cpu_moe": 1}).threads == 2


def test_create_api_refuses_an_out_of_range_parameter_from_a_modelfile(tmp_path):
    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "tiny.gguf"))
    modelfile = parse_modelfile("FROM tiny\nPARAMETER num_thread 1000\n")
    with pytest.raises(ModelfileError, match="invalid value for num_thread: 1000"):
        list(create_model("thr", modelfile, store, tmp_path))
    assert not store.exists("thr")


# ---- against a real `dgemma serve` and the real engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(tmp_path_factory, gguf_path):
    """`dgemma serve` over a store holding tiny-a as F16 (the soft-embedding op path that 1000 threads overflowed),
    and `stored-thr`: the same weights stored with `num_thread 1000`, as create used to accept."""
    root = tmp_path_factory.mktemp("ranges")
    store = Store(root / "models")
    gguf = gguf_path("tiny-a", "f16")
    add_model(store, "tiny", gguf)
    add_model(store, "stored-thr", gguf, parameters={"num_thread": 1000})
    with ServeProcess(store.root, {"DGEMMA_NOPRUNE": "1"}) as served:
        yield served, store


GEN = {"prompt": "Hi", "stream": False, "options": {"num_predict": 16, "diffusion_steps": 2, "seed": 1}}


def test_absurd_threads_never_reach_the_engine(real_server):
    served, store = real_server
    client = httpx.Client(base_url=served.url, timeout=60)
    assert client.post("/api/generate", json={**GEN, "model": "tiny"}).status_code == 200
    start = time.monotonic()
    r = client.post("/api/create", json={"model": "thr", "from": "tiny", "parameters": {"num_thread": 1000},
                                         "stream": False})
    assert r.status_code == 400
    assert r.json()["error"].startswith("invalid value for num_thread: 1000 (must be between 0 and ")
    assert not store.exists("thr")
    r = client.post("/api/generate", json={**GEN, "model": "stored-thr"})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("the model's parameters are invalid: invalid value for num_thread: 1000")
    r = client.post("/api/generate", json={**GEN, "model": "tiny", "options": {**GEN["options"], "num_thread": 1000}})
    assert r.status_code == 400 and "num_thread" in r.json()["error"]
    assert time.monotonic() - start < 5
    assert served.process.poll() is None
    assert client.post("/api/generate", json={**GEN, "model": "tiny"}).status_code == 200


# ---- REST create checks what a Modelfile checks (item 14) ------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("create-checks")
    store = Store(root / "models")
    add_model(store, "tiny", write_small_gguf(root / "tiny.gguf"))
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour())) as server:
        yield httpx.Client(base_url=server.url, timeout=30), store


@pytest.mark.parametrize("fields,message", [
    ({"messages": [{"role": "wizard", "content": "x"}]},
     'messages[0]: message role must be one of "system", "user", or "assistant"'),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0]: message content must be a string"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     'messages[0]: a stored message has only "role" and "content", not "images"'),
    ({"messages": [{"role": "user", "content": 'say """'}]}, "value may not contain '\"\"\"'"),
    ({"requires": "1.2.3-" + "a" * 9994}, "requires must be a valid semver (e.g. 0.14.0)"),
    ({"requires": "x" * 10_000}, "requires must be a valid semver (e.g. 0.14.0)"),
    ({"parameters": {"tfs_z": 1.0}}, "unknown parameter 'tfs_z'"),
    ({"parameters": {"stop": ['a"""b']}}, "value may not contain '\"\"\"'"),
    ({"parameters": {"num_parallel": 0}}, "invalid value for num_parallel: 0 (must be between 1 and 64)"),
    ({"system": 'x"""'}, "value may not contain '\"\"\"'"),
])
def test_create_api_refuses_what_a_modelfile_refuses(served, fields, message):
    client, store = served
    r = client.post("/api/create", json={"model": "refused", "from": "tiny", "stream": False, **fields})
    assert (r.status_code, r.json()) == (400, {"error": message})
    assert not store.exists("refused")


def test_show_modelfile_of_a_rest_created_model_creates_the_same_model(served):
    client, store = served
    body = {"model": "made", "from": "tiny", "stream": False, "system": "Be brief.\nVery.",
            "template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
            "license": ["MIT", 'quote "this"'],
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " padded "}],
            "parameters": {"temperature": 1, "num_ctx": 2048.0, "stop": ["<end>", "two\nlines"], "num_thread": 0,
                           "use_mmap": False, "diffusion_steps": 8, "mirostat": 1, "seed": None},
            "requires": "0.14.0"}
    assert client.post("/api/create", json=body).status_code == 200
    shown = client.post("/api/show", json={"model": "made"}).json()
    modelfile = checked_modelfile(parse_modelfile(shown["modelfile"]))  # what `dgemma create -f` would send
    assert modelfile.parameters == {"temperature": 1.0, "num_ctx": 2048, "stop": ["<end>", "two\nlines"],
                                    "num_thread": 0, "use_mmap": False, "diffusion_steps": 8}
    again = {"model": "again", "from": "tiny", "stream": False, "system": modelfile.system,
             "template": modelfile.template, "license": modelfile.licenses, "messages": modelfile.messages,
             "parameters": modelfile.parameters}
    assert client.post("/api/create", json=again).status_code == 200

    def layers(name: str) -> list:
        return [(layer.media_type, layer.digest) for layer in store.read_manifest(name).layers]

    assert layers("again") == layers("made") and any(media == MEDIA_MODEL for media, _ in layers("made"))
