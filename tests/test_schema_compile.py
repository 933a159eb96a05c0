"""Structured output's compile step (docs/generation.md, "Structured output"): done before the request queues for the
model, in a child process limited in CPU time and killed when the client leaves, cached per (vocabulary, schema) in
memory and on disk. Hostile schemas get a quick 400 and do not slow the requests around them; "any JSON object" is
compiled into the store's cache when a model is created or pulled (a compile that fails there fails neither), in the
background when a model loads, and is never refused."""
import hashlib
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from dgemma_cli.server.schema_compiler import read_vocabulary
from dgemma_engine.automata import (CompileLimitExceeded, CompileStopped, Vocabulary, cache_file, compile_isolated,
                                    load_automaton, save_automaton)
from json_schemas import HOSTILE_SCHEMAS, SCHEMAS
from server_harness import InProcessServer, ServeProcess, ndjson

LIMIT_S = 2.0                   # DGEMMA_SCHEMA_COMPILE_TIMEOUT of the served tests
SLACK_S = 10.0                  # a child at the lowest priority on a busy 2-core machine gets its CPU late
PERSON = SCHEMAS["object-required"]
PLAIN = {"model": "tiny", "prompt": "Tell me a story.", "stream": False,
         "options": {"num_predict": 32, "diffusion_steps": 8, "seed": 1}}

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds compile children in /proc")


def compile_children(pid: int) -> list[int]:
    """Live compile children (`python -m dgemma_engine.automata`) of process `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == pid and b"dgemma_engine.automata" in command:
            found.append(int(entry.name))
    return found


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---- the isolated compile and its cache files ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocabulary(gguf_path) -> Vocabulary:
    return read_vocabulary(str(gguf_path("tiny-a", "f32")))


def tokenizer_metadata(path: Path) -> dict:
    """The tokenizer keys as gguf's own reader gives them."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    return {key: f.contents() for key, f in reader.fields.items() if key.startswith("tokenizer.")}


def test_the_vocabulary_is_read_from_the_file_alone(vocabulary, gguf_path, tmp_path):
    """Short arrays (tiny-a, 512 tokens) and long ones (3,000 tokens, which the GGUF check otherwise summarises)."""
    from gguf import GGUFWriter

    expected = Vocabulary.from_metadata(tokenizer_metadata(gguf_path("tiny-a", "f32")))
    assert vocabulary.token_map == expected.token_map and vocabulary.digest == expected.digest
    assert vocabulary.stop_ids == (1, 106, 50) and all(1 not in ids for ids in vocabulary.token_map.values())
    long = tmp_path / "long.gguf"
    writer = GGUFWriter(str(long), "diffusion-gemma")
    writer.add_token_list(["<pad>", "<eos>"] + [f"w{i}" for i in range(2998)])
    writer.add_token_types([3, 3] + [1] * 2998)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_vocabulary(str(long))
    expected = Vocabulary.from_metadata(tokenizer_metadata(long))
    assert read.n_tokens == 3000 and read.token_map == expected.token_map and read.digest == expected.digest
    assert read.digest != vocabulary.digest


@pytest.fixture(scope="module")
def person_file(vocabulary, tmp_path_factory) -> Path:
    path = cache_file(tmp_path_factory.mktemp("automata"), vocabulary, PERSON)
    compile_isolated(PERSON, vocabulary, path, cpu_limit_s=30)
    return path


def test_a_cache_file_reads_back_as_the_automaton_compiled(vocabulary, person_file):
    from dgemma_engine.automata import compile_for_vocabulary

    expected = compile_for_vocabulary(PERSON, vocabulary)
    loaded = load_automaton(person_file, vocabulary.n_tokens)
    assert loaded is not None and loaded.n_states == expected.n_states and loaded.initial == expected.initial
    assert loaded.finals == expected.finals
    for name in ("src", "tok", "dst", "seg_starts", "seg_dst", "tokens_to_close"):
        assert np.array_equal(getattr(loaded, name), getattr(expected, name)), name


def damaged(person_file: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / "damaged.npz"
    if how == "garbage":
        path.write_bytes(b"not a numpy archive")
    elif how == "truncated":
        path.write_bytes(person_file.read_bytes()[:200])
    else:
        with np.load(person_file) as data:
            arrays = {name: data[name] for name in data.files}
        if how == "token out of range":
            arrays["tok"] = arrays["tok"] + 10**6
        elif how == "state out of range":
            arrays["src"] = arrays["src"] + arrays["n_states"]
        elif how == "edges out of order":
            arrays["dst"] = arrays["dst"][::-1].copy()
        elif how == "array missing":
            del arrays["seg_dst"]
        elif how == "object array":
            arrays["tok"] = np.array([object()] * len(arrays["tok"]))
        save_automaton_arrays(path, arrays)
    return path


def save_automaton_arrays(path: Path, arrays: dict) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("how", ["garbage", "truncated", "token out of range", "state out of range",
                                 "edges out of order", "array missing", "object array"])
def test_a_damaged_cache_file_is_ignored(vocabulary, person_file, tmp_path, how):
    assert load_automaton(damaged(person_file, tmp_path, how), vocabulary.n_tokens) is None
    assert load_automaton(tmp_path / "absent.npz", vocabulary.n_tokens) is None


def test_writing_a_cache_file_leaves_no_partial_file(vocabulary, person_file, tmp_path):
    automaton = load_automaton(person_file, vocabulary.n_tokens)
    path = tmp_path / "a" / "b.npz"
    save_automaton(path, automaton)
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.npz"]
    assert load_automaton(path, vocabulary.n_tokens) is not None


def test_the_cpu_limit_stops_a_hostile_compile(vocabulary, tmp_path):
    started = time.monotonic()
    with pytest.raises(CompileLimitExceeded, match="more than 1 s of CPU time"):
        compile_isolated(HOSTILE_SCHEMAS["min-length"], vocabulary, tmp_path / "x.npz", cpu_limit_s=1)
    assert time.monotonic() - started < 1 + SLACK_S
    assert not (tmp_path / "x.npz").exists()


@needs_proc
def test_stopping_a_compile_kills_its_child(vocabulary, tmp_path):
    import os

    stop = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            compile_isolated(HOSTILE_SCHEMAS["pattern-blowup"], vocabulary, tmp_path / "x.npz", cpu_limit_s=60,
                             stop=stop)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    assert wait_until(lambda: compile_children(os.getpid()), 10), "the compile child never started"
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive() and isinstance(outcome[0], CompileStopped)
    assert compile_children(os.getpid()) == []


# ---- through `dgemma serve` ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("schema-compile")
    env = {"DGEMMA_NOPRUNE": "1", "DGEMMA_SCHEMA_COMPILE_TIMEOUT": f"{LIMIT_S:g}"}
    with ServeProcess(root / "models", env) as server, httpx.Client(base_url=server.url, timeout=600) as client:
        data = gguf_path("tiny-a", "f32").read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        client.post(f"/api/blobs/{digest}", content=data).raise_for_status()
        created = client.post("/api/create", json={"model": "tiny", "files": {"tiny-a.gguf": digest}})
        assert created.status_code == 200, created.text
        server.create_statuses = [line["status"] for line in ndjson(created)]
        yield server, client, root / "models"


def json_object_file(models: Path, gguf: Path) -> Path:
    """Where the store's cache keeps "any JSON object" for the model in `gguf`."""
    return cache_file(models / "cache" / "automata", read_vocabulary(str(gguf)), None)


def cached_soon(path: Path, timeout: float = 240.0) -> bool:
    """Whether the background compile a create or pull started has written `path` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if load_automaton(path, 512) is not None:
            return True
        time.sleep(0.25)
    return False


def test_create_answers_at_once_and_compiles_any_json_object_into_the_store_in_the_background(served, gguf_path):
    server, _, models = served
    assert server.create_statuses[-2:] == ["writing manifest", "success"]  # the compile is not waited for
    assert cached_soon(json_object_file(models, gguf_path("tiny-a", "f32")))


def generate(client: httpx.Client, schema=None, **overrides) -> tuple[httpx.Response, float]:
    body = {**PLAIN, **overrides}
    if schema is not None:
        body["format"] = schema
    started = time.monotonic()
    response = client.post("/api/generate", json=body)
    return response, time.monotonic() - started


@pytest.mark.parametrize("label", list(HOSTILE_SCHEMAS))
def test_a_hostile_schema_gets_a_400_within_the_limit(served, label):
    _, client, _ = served
    response, seconds = generate(client, HOSTILE_SCHEMAS[label])
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    assert error == (f"the JSON schema is too complex: compiling it takes more than {LIMIT_S:g} s of CPU time "
                     "(DGEMMA_SCHEMA_COMPILE_TIMEOUT)")
    assert seconds < LIMIT_S + SLACK_S
    again, seconds = generate(client, HOSTILE_SCHEMAS[label])  # known to be over the limit: refused at once
    assert again.status_code == 400 and again.json()["error"] == error and seconds < 1.0


def test_a_hostile_schema_is_refused_on_the_openai_route_too(served):
    _, client, _ = served
    schema = {"type": "string", "minLength": 100001}
    response = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert response.status_code == 400 and "DGEMMA_SCHEMA_COMPILE_TIMEOUT" in response.json()["error"]["message"]


@needs_proc
def test_a_client_that_leaves_stops_its_compile_and_frees_the_model(served):
    server, client, _ = served
    pid = server.process.pid
    hostile = {"type": "string", "minLength": 100002}
    with httpx.Client(base_url=server.url, timeout=1.0) as impatient:
        seen: list[bool] = []
        watcher = threading.Thread(target=lambda: seen.append(bool(wait_until(lambda: compile_children(pid), 1.0))))
        watcher.start()
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/api/generate", json={**PLAIN, "format": hostile})
        watcher.join()
    assert seen == [True], "the compile child never ran"
    # the server polls for a gone client every 250 ms, then kills the child
    assert wait_until(lambda: compile_children(pid) == [], 2.0), compile_children(pid)
    response, seconds = generate(client)
    assert response.status_code == 200 and seconds < 30


def test_any_json_object_is_never_refused_and_comes_from_the_creates_compile(served, gguf_path):
    """"Any JSON object" on tiny-a takes several CPU seconds, more than the 2 s limit; it was compiled when the model
    was created, and the request reads it (the load-time compile, for a model whose create did not compile it, is
    tested below)."""
    _, client, models = served
    compiled = json_object_file(models, gguf_path("tiny-a", "f32"))
    written = compiled.stat().st_mtime_ns
    assert generate(client)[0].status_code == 200
    response, _ = generate(client, "json", options={"num_predict": 32, "diffusion_steps": 2, "seed": 3})
    assert response.status_code == 200, response.text
    assert isinstance(json.loads(response.json()["response"]), dict)
    assert compiled.stat().st_mtime_ns == written


def test_compiled_schemas_survive_a_restart_and_a_damaged_file_is_recompiled(served):
    _, client, models = served
    options = {"num_predict": 32, "diffusion_steps": 2, "seed": 4}
    assert generate(client, "json", options=options)[0].status_code == 200
    before = {p: p.stat().st_mtime_ns for p in (models / "cache" / "automata").rglob("*.npz")}
    assert generate(client, PERSON, options=options)[0].status_code == 200
    (person_file,) = set((models / "cache" / "automata").rglob("*.npz")) - set(before)
    with ServeProcess(models, {"DGEMMA_NOPRUNE": "1"}) as second, httpx.Client(base_url=second.url,
                                                                              timeout=600) as other:
        response, _ = generate(other, "json", options=options)
        assert response.status_code == 200
        assert {p: p.stat().st_mtime_ns for p in before} == before  # read from the disk cache, not compiled again
        person_file.write_bytes(b"damaged")
        response, _ = generate(other, PERSON, options=options)
        assert response.status_code == 200
        jsonschema_valid(json.loads(response.json()["response"]), PERSON)
    assert person_file.read_bytes()[:2] == b"PK"  # rewritten by the recompile


def jsonschema_valid(value, schema) -> None:
    import jsonschema

    jsonschema.validate(value, schema)


@needs_proc
def test_hostile_compiles_leave_a_concurrent_request_within_thrice_its_quiet_latency(served):
    """Rounds of a quiet request, then one sent while two hostile compiles run (interleaved, so that the load the
    rest of the machine puts on both is alike)."""
    server, client, _ = served
    pid = server.process.pid
    assert generate(client, "json")[0].status_code == 200  # nothing left compiling in the background
    # long enough (~0.5 s quiet on a fast CPU) that scheduling quanta and timer jitter do not count
    options = {"num_predict": 192, "diffusion_steps": 48, "seed": 1}
    quiet, beside, refusals = [], [], []

    def attack(schema) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as attacker:
            refusals.append(attacker.post("/api/generate", json={**PLAIN, "format": schema}).status_code)

    for round_ in range(5):
        assert wait_until(lambda: compile_children(pid) == [], 120)
        quiet.append(generate(client, options=options)[1])
        attackers = [threading.Thread(target=attack, args=({"type": "string", "pattern": f"^(a|b)*a(a|b){{{n}}}$"},))
                     for n in (30 + 2 * round_, 31 + 2 * round_)]
        for thread in attackers:
            thread.start()
        assert wait_until(lambda: len(compile_children(pid)) == 2, 30), "the hostile compiles did not start"
        response, seconds = generate(client, options=options)
        assert response.status_code == 200 and len(compile_children(pid)) == 2  # they ran all along
        beside.append(seconds)
        for thread in attackers:
            thread.join()
    assert refusals == [400] * 10
    print(f"quiet {quiet}, beside two hostile compiles {beside}")
    # measured: 1.36x on a 2-core AMD Zen 3 guest; 1.8-2.0x on a 2-core Intel Xeon guest (Linux 6.18), where the
    # compiles only run while a vCPU idles but still share the host core; without the low priority the request
    # waits for the compiles (2.5-5x there with nice 19 alone)
    assert statistics.median(beside) <= 3 * statistics.median(quiet)


# ---- a compile that fails at create; pull ----------------------------------------------------------------------------

def test_a_failing_compile_does_not_fail_create_and_pull_writes_the_cache_file(tmp_path, gguf_path, registry,
                                                                               monkeypatch):
    """In a server of its own (in this process, so that the compile can be made to fail): the create succeeds without
    the file; a `format: "json"` request then compiles it (waiting for it, above the request limit); a pull of the
    same weights writes the file again once it is gone."""
    import dgemma_engine.automata as automata
    from dgemma_cli.server.app import default_runner_factory
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import MEDIA_MODEL, Store

    models = tmp_path / "models"
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(models), "DGEMMA_NOPRUNE": "1",
                                    "DGEMMA_SCHEMA_COMPILE_TIMEOUT": f"{LIMIT_S:g}"})
    gguf = gguf_path("tiny-a", "f32")
    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    compiled = json_object_file(models, gguf)

    tried = threading.Event()

    def broken(*args, **kwargs):
        tried.set()
        raise RuntimeError("the compiler crashed")

    with InProcessServer(config, Store(models), default_runner_factory) as server, \
            httpx.Client(base_url=server.url, timeout=600) as client:
        client.post(f"/api/blobs/{digest}", content=data).raise_for_status()
        with monkeypatch.context() as patched:
            patched.setattr(automata, "compile_isolated", broken)
            created = client.post("/api/create", json={"model": "tiny", "files": {"tiny-a.gguf": digest}})
            assert tried.wait(120)  # the background compile the create started ran, and failed
        assert created.status_code == 200, created.text
        assert [line["status"] for line in ndjson(created)][-2:] == ["writing manifest", "success"]
        assert not compiled.exists()

        response, _ = generate(client, "json", options={"num_predict": 32, "diffusion_steps": 2, "seed": 5})
        assert response.status_code == 200, response.text
        assert isinstance(json.loads(response.json()["response"]), dict)
        assert load_automaton(compiled, 512) is not None

        compiled.unlink()
        registry.add_model("library/tiny:latest", [(MEDIA_MODEL, data)])
        pulled = client.post("/api/pull", json={"model": f"{registry.host}/library/tiny:latest", "insecure": True})
        assert pulled.status_code == 200, pulled.text
        assert [line.get("status") for line in ndjson(pulled)][-1] == "success"
        assert cached_soon(compiled)


# ---- a vocabulary that cannot write JSON -----------------------------------------------------------------------------

def test_a_vocabulary_without_json_is_known_once_and_format_is_refused_in_one_line(tmp_path):
    """The bundled Sudoku model writes digits only: `format` is refused at once with one line (no compile, no regex
    in the answer or the log), and the server says so in one short log line however often it is asked."""
    from dgemma_engine.constrained import VOCABULARY_CANNOT_WRITE

    with ServeProcess(tmp_path / "models", {"DGEMMA_NOPRUNE": "1"}) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(3):
            started = time.monotonic()
            response = client.post("/api/chat", json={"model": "sudoku", "format": "json", "stream": False,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 400, response.text
            assert response.json() == {"error": VOCABULARY_CANNOT_WRITE}
            assert time.monotonic() - started < 10  # the compile took 14 s before it said so
        time.sleep(1.0)  # the load's background compile logs too
        logs = server.logs()
    mentions = [line for line in logs.splitlines() if "JSON object" in line]
    assert len(mentions) == 1 and "no token opens a JSON object" in mentions[0], mentions
    assert max(len(line) for line in logs.splitlines()) < 400
