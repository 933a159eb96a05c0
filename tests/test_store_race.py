"""Concurrent writers of one store (issue 14): same-name creates in threads, in two processes and through the API
never leave a manifest pointing at a pruned blob, and a killed create leaves nothing in $TMPDIR."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dgemma_cli.create import create_model
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import SCRATCH_DIR, Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

TESTS = Path(__file__).parent
ROUNDS = 30


@pytest.fixture
def store(tmp_path) -> Store:
    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "tiny.gguf"))
    return store


def assert_store_consistent(store: Store) -> None:
    for name, _path in store.iter_manifests():
        manifest = store.read_manifest(name)
        assert not store.missing_blobs(manifest), f"{name.display} points at a pruned blob"
        store.resolve(name)  # every layer readable


def create(store: Store, name: str, system: str) -> None:
    list(create_model(name, parse_modelfile(f"FROM tiny\nSYSTEM {system}\n"), store, store.root))


def test_same_name_creates_in_threads(store):
    for round_ in range(ROUNDS):
        errors: list[BaseException] = []

        def run(system: str) -> None:
            try:
                create(store, "race", system)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"{label}-sys-{round_}",)) for label in "AB"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert_store_consistent(store)
        assert store.resolve("race").system in (f"A-sys-{round_}", f"B-sys-{round_}")


CHILD = """
import sys
from dgemma_cli.create import create_model
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.store import Store
store, label = Store(sys.argv[1]), sys.argv[2]
for i in range(int(sys.argv[3])):
    list(create_model("race", parse_modelfile(f"FROM tiny\\nSYSTEM {label}-sys-{i % 3}\\n"), store, store.root))
"""


def test_same_name_creates_in_two_processes(store):
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(store.root), label, "25"], cwd=TESTS)
                for label in "AB"]
    for child in children:
        assert child.wait(timeout=120) == 0
    assert_store_consistent(store)


def test_same_name_creates_through_the_api(store):
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour())) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        for round_ in range(10):
            answers: list[int] = []

            def post(system: str) -> None:
                body = {"model": "race", "from": "tiny", "system": system, "stream": False}
                answers.append(client.post("/api/create", json=body).status_code)

            threads = [threading.Thread(target=post, args=(f"{label}-sys-{round_}",)) for label in "AB"]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert answers == [200, 200]
            assert client.post("/api/show", json={"model": "race"}).status_code == 200
            assert_store_consistent(store)


# ---- a killed create ------------------------------------------------------------------------------------------------

HANG = """
import sys, time
from pathlib import Path
import dgemma_cli.create as create
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.store import Store

def hang(*args, **kwargs):
    print("ready", flush=True)
    time.sleep(60)

store, how = Store(sys.argv[1]), sys.argv[2]
if how == "server-side":  # the in-process create (the CLI's fallback and the server)
    create.validated_gguf = hang
    list(create.create_model("killed", parse_modelfile("FROM ./tiny.gguf"), store, Path(sys.argv[3])))
else:  # the CLI's local half: converting a checkpoint folder before the upload
    import dgemma_convert
    from dgemma_cli import store_client
    dgemma_convert.convert = hang
    with store_client._converted(Path(sys.argv[3]), None, lambda event: None):
        pass
"""


@pytest.mark.parametrize("how", ["server-side", "client-side"])
def test_killed_create_leaves_nothing_in_tmpdir(store, tmp_path, how):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    write_small_gguf(tmp_path / "tiny.gguf")
    env = {**os.environ, "TMPDIR": str(tmpdir), "DGEMMA_MODELS": str(store.root)}
    child = subprocess.Popen([sys.executable, "-c", HANG, str(store.root), how, str(tmp_path)], cwd=TESTS, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        scratch = store.root / SCRATCH_DIR
        assert len(list(scratch.iterdir())) == 1  # the create's work folder, inside the store
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert list(tmpdir.iterdir()) == []
    create(store, "next", "after the kill")  # the next create sweeps the dead owner's folder
    assert list(scratch.iterdir()) == []
    assert_store_consistent(store)


def test_a_live_scratch_folder_is_not_swept(store):
    with store.scratch("create") as mine:
        (mine / "half.gguf").write_bytes(b"x")
        with store.scratch("create") as other:
            assert mine.is_dir() and other != mine
        assert (mine / "half.gguf").is_file()
    assert not mine.exists()
    started = time.monotonic()
    with store.write_lock(), store.write_lock():  # reentrant in one thread
        pass
    assert time.monotonic() - started < 1
