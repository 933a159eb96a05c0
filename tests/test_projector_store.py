"""Vision projectors in the store (docs/store.md, "Vision projectors"): `FROM model.gguf` + `FROM mmproj.gguf`, a
FROM folder holding both, a projector added to an existing model, `/api/create` with both files, a pulled manifest
with a projector layer, and what `show` says (`vision` capability, the Projector block, the second FROM).

The projector files are the smallest ones the vision engine loads, written with gguf-py
(`store_helpers.write_tiny_projector`); the converter's own projector output is tested with the vision engine."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import ollama
import pytest

from cli_helpers import cli_env, in_process
from dgemma_cli.create import CreateError, create_model
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.registry import PullOptions, pull
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import MEDIA_MODEL, MEDIA_PROJECTOR, MEDIA_SYSTEM, Store, sha256_file
from server_harness import FakeBehaviour, InProcessServer, fake_factory
from store_helpers import write_tiny_gguf, write_tiny_projector


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def files(tmp_path) -> tuple[Path, Path]:
    """A tiny text model (embedding length 8) and a projector that fits it."""
    return write_tiny_gguf(tmp_path / "model.gguf"), write_tiny_projector(tmp_path / "mmproj.gguf")


def create(store: Store, name: str, text: str, base: Path) -> list[dict]:
    return list(create_model(name, parse_modelfile(text), store, base))


def media_types(store: Store, name: str) -> list[str]:
    return [layer.media_type for layer in store.read_manifest(name).layers]


def test_two_froms_make_a_model_and_a_projector_layer(store, files, tmp_path):
    model, projector = files
    create(store, "vis", "FROM ./model.gguf\nFROM ./mmproj.gguf\nSYSTEM hi\n", tmp_path)
    assert media_types(store, "vis") == [MEDIA_MODEL, MEDIA_PROJECTOR, MEDIA_SYSTEM]
    local = store.resolve("vis")
    assert local.gguf_path.read_bytes() == model.read_bytes()
    assert local.projector is not None and sha256_file(local.projector) == sha256_file(projector)
    # the order of the FROM lines does not matter: the architecture tells which file is which
    create(store, "vis2", "FROM ./mmproj.gguf\nFROM ./model.gguf\nSYSTEM hi\n", tmp_path)
    assert store.read_manifest("vis2").layers == store.read_manifest("vis").layers


def test_a_folder_holding_both_ggufs(store, files, tmp_path):
    folder = tmp_path / "both"
    folder.mkdir()
    for path in files:
        shutil.copy(path, folder / path.name)
    create(store, "vis", "FROM ./both\n", tmp_path)
    assert media_types(store, "vis") == [MEDIA_MODEL, MEDIA_PROJECTOR]


def test_text_only_model_has_no_projector(store, files, tmp_path):
    create(store, "text", "FROM ./model.gguf\n", tmp_path)
    assert store.resolve("text").projector is None


@pytest.mark.parametrize("modelfile,message", [
    ("FROM ./model.gguf\nFROM ./other.gguf\n", "a Modelfile takes one model: a second FROM may only be a vision "
                                               'projector GGUF (general.architecture "clip")'),
    ("FROM ./mmproj.gguf\n", "no model in FROM: a vision projector needs its model"),
    ("FROM ./model.gguf\nFROM ./mmproj.gguf\nFROM ./mmproj2.gguf\n", "a Modelfile takes at most one vision projector"),
    ("FROM ./model.gguf\nFROM ./wide.gguf\n", "projector wide.gguf does not fit the model: it makes embeddings of 16 "
                                              "values, the model's are 8"),
    ("FROM ./model.gguf\nFROM ./llava.gguf\n", 'invalid projector llava.gguf: projector type "mlp" is not supported'),
])
def test_bad_projector_modelfiles_are_one_line_and_store_nothing(store, files, tmp_path, modelfile, message):
    write_tiny_gguf(tmp_path / "other.gguf")
    write_tiny_projector(tmp_path / "mmproj2.gguf", max_soft_tokens=8)
    write_tiny_projector(tmp_path / "wide.gguf", n_embd_text=16)
    write_tiny_projector(tmp_path / "llava.gguf", projector_type="mlp")
    with pytest.raises(CreateError) as info:
        create(store, "bad", modelfile, tmp_path)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert not store.exists("bad")
    assert not store.blobs_dir.is_dir() or not any(store.blobs_dir.iterdir())


def test_existing_model_keeps_or_replaces_its_projector(store, files, tmp_path):
    create(store, "vis", "FROM ./model.gguf\nFROM ./mmproj.gguf\n", tmp_path)
    create(store, "child", "FROM vis\nSYSTEM child\n", tmp_path)
    assert store.resolve("child").projector == store.resolve("vis").projector
    create(store, "text", "FROM ./model.gguf\n", tmp_path)
    other = write_tiny_projector(tmp_path / "other-mmproj.gguf", max_soft_tokens=8)
    create(store, "added", "FROM text\nFROM ./other-mmproj.gguf\n", tmp_path)
    assert media_types(store, "added") == [MEDIA_MODEL, MEDIA_PROJECTOR]
    create(store, "swapped", "FROM vis\nFROM ./other-mmproj.gguf\n", tmp_path)
    assert media_types(store, "swapped") == [MEDIA_MODEL, MEDIA_PROJECTOR]
    assert sha256_file(store.resolve("swapped").projector) == sha256_file(other)


def test_pull_of_a_manifest_with_a_projector_layer(registry, tmp_path):
    model = write_tiny_gguf(tmp_path / "model.gguf").read_bytes()
    projector = write_tiny_projector(tmp_path / "mmproj.gguf").read_bytes()
    store = Store(tmp_path / "store")
    registry.add_model("library/vis:latest", [(MEDIA_MODEL, model), (MEDIA_PROJECTOR, projector)])
    options = PullOptions(part_size=256, streams=2, retries=1, backoff=0.01, free_disk_margin=0)
    events = list(pull(f"{registry.host}/library/vis:latest", store, insecure=True, options=options))
    assert events[-1]["status"] == "success"
    local = store.resolve(f"{registry.host}/library/vis:latest")
    assert local.projector is not None and local.projector.read_bytes() == projector
    assert local.gguf_path.read_bytes() == model


@pytest.fixture
def served(tmp_path):
    store = Store(tmp_path / "store")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour(answer="ok"))) as server:
        yield server, store, ollama.Client(host=server.url)


def test_api_create_with_model_and_projector_files_and_show(served, files):
    server, store, client = served
    model, projector = files
    digests = {"model.gguf": client.create_blob(model), "mmproj.gguf": client.create_blob(projector)}
    assert client.create(model="vis", files=digests).status == "success"
    assert media_types(store, "vis") == [MEDIA_MODEL, MEDIA_PROJECTOR]
    show = httpx.post(f"{server.url}/api/show", json={"model": "vis"}).json()
    assert show["capabilities"][:3] == ["completion", "diffusion", "vision"]  # vision before tools, as Ollama
    info = show["projector_info"]
    assert info["general.architecture"] == "clip" and info["clip.vision.projection_dim"] == 8
    assert info["general.parameter_count"] == 11200
    # the projector is the Modelfile's second FROM, as Ollama prints it
    froms = [line for line in show["modelfile"].splitlines() if line.startswith("FROM ")]
    assert froms == [f"FROM {store.resolve('vis').gguf_path}", f"FROM {store.resolve('vis').projector}"]
    # a projector alone, or two, are refused before anything is written
    with pytest.raises(ollama.ResponseError, match="no model in FROM"):
        client.create(model="lonely", files={"mmproj.gguf": digests["mmproj.gguf"]})
    # `from` names the model when the files hold only the projector
    assert client.create(model="text", files={"model.gguf": digests["model.gguf"]}).status == "success"
    assert "vision" not in httpx.post(f"{server.url}/api/show", json={"model": "text"}).json()["capabilities"]
    assert client.create(model="text-vis", from_="text", files={"p.gguf": digests["mmproj.gguf"]}).status == "success"
    assert media_types(store, "text-vis") == [MEDIA_MODEL, MEDIA_PROJECTOR]


def test_cli_create_with_two_froms_and_show_projector_block(tmp_path, files):
    env = cli_env(tmp_path)
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\nFROM ./mmproj.gguf\n")
    code, _, err = in_process(env, "create", "vis", "-f", str(tmp_path / "Modelfile"))
    assert code == 0, err
    code, out, err = in_process(env, "show", "vis")
    assert code == 0, err
    assert "  Projector\n" in out
    block = out.split("  Projector\n")[1].split("\n\n")[0]
    assert [line.split()[0] for line in block.splitlines()] == ["architecture", "parameters", "embedding", "dimensions"]
    assert "clip" in block and "11.2K" in block and "32" in block and block.rstrip().endswith("8")
    assert "vision" in out.split("  Capabilities\n")[1].split("\n\n")[0]
    # show --modelfile round-trips: both FROM lines are blobs the server has
    code, text, err = in_process(env, "show", "vis", "--modelfile")
    assert code == 0, err
    (tmp_path / "Modelfile.shown").write_text(text)
    code, _, err = in_process(env, "create", "again", "-f", str(tmp_path / "Modelfile.shown"))
    assert code == 0, err
    store = Store(tmp_path / "store")
    assert store.read_manifest("again").layers[:2] == store.read_manifest("vis").layers[:2]


# ---- FROM a checkpoint with a vision tower: both parts converted --------------------------------------------------

TINY_V = Path(__file__).parent / "fixtures" / "tiny-v"


def test_from_a_checkpoint_with_a_vision_tower_converts_both_parts(store, tmp_path):
    statuses = [e["status"] for e in create(store, "tiny-v", f"FROM {TINY_V}\n", tmp_path)]
    assert "converting projector" in statuses
    assert media_types(store, "tiny-v") == [MEDIA_MODEL, MEDIA_PROJECTOR]
    from dgemma_cli.projector import projector_info

    assert projector_info(store.resolve("tiny-v").projector).max_soft_tokens > 0
