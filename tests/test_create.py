"""`create_model` from each FROM source, layer media types, config blob, and the show-Modelfile round trip."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dgemma_cli.create import create_model, human_number
from dgemma_cli.errors import DgemmaError
from dgemma_cli.gguf_check import read_gguf_info
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.registry import PullOptions
from dgemma_cli.store import (
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Store,
    canonical_json,
    sha256_file,
)
from registry_server import FakeRegistry
from store_helpers import write_tiny_gguf

FIXTURES = Path(__file__).parent / "fixtures"


def create(store: Store, name: str, text: str, base: Path, **kw) -> list[dict]:
    return list(create_model(name, parse_modelfile(text), store, base, **kw))


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "store")


def test_create_from_local_gguf_writes_ollama_layers(store, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    events = create(store, "demo", 'FROM ./tiny.gguf\nTEMPLATE "{{ .System }} {{ .Prompt }}"\nSYSTEM Be brief.\n'
                    "PARAMETER diffusion_steps 16\nPARAMETER stop <end>\nMESSAGE user Hi\nLICENSE MIT\n", tmp_path)
    statuses = [e["status"] for e in events]
    assert statuses[0] == "parsing GGUF" and statuses[-2:] == ["writing manifest", "success"]
    assert f"creating new layer {sha256_file(gguf)}" in statuses

    manifest = store.read_manifest("demo")
    types = [layer.media_type for layer in manifest.layers]
    assert types == [MEDIA_MODEL, MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_PARAMS, MEDIA_MESSAGES, MEDIA_LICENSE]
    assert manifest.layers[0].from_ == "tiny.gguf" and manifest.layers[0].digest == sha256_file(gguf)
    assert manifest.raw == canonical_json(json.loads(manifest.raw))  # created manifests are canonical JSON
    assert json.loads(manifest.raw)["config"]["mediaType"] == "application/vnd.docker.container.image.v1+json"
    config = json.loads(store.blob_path(manifest.config.digest).read_bytes())
    info = read_gguf_info(gguf)
    assert config == {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"],
                      "model_type": human_number(info.parameter_count), "file_type": "F32",
                      "architecture": "amd64", "os": "linux", "template_format": "go"}
    model = store.resolve("demo")
    assert model.parameters == {"diffusion_steps": 16, "stop": ["<end>"]}
    assert model.system == "Be brief." and model.license == ["MIT"]
    assert model.messages == [{"role": "user", "content": "Hi"}]
    assert model.gguf_path == store.blob_path(sha256_file(gguf))


def test_create_from_folder_with_one_gguf(store, tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    gguf = write_tiny_gguf(folder / "model.gguf")
    create(store, "folder-model", "FROM weights", tmp_path)
    assert store.resolve("folder-model").gguf_path.read_bytes() == gguf.read_bytes()


def test_folder_entry_resolving_outside_is_refused(store, tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(write_tiny_gguf(tmp_path / "elsewhere.gguf"))
    with pytest.raises(DgemmaError, match="^insecure path: model.gguf$"):
        create(store, "m", "FROM weights", tmp_path)
    assert not store.list_models()


def test_create_from_hf_checkpoint_folder_converts_on_the_fly(store, tmp_path):
    events = create(store, "tiny-a", f"FROM {FIXTURES / 'tiny-a'}\n", tmp_path)
    assert {"status": "converting model"} in events
    model = store.resolve("tiny-a")
    info = read_gguf_info(model.gguf_path)
    assert info.architecture == "diffusion-gemma" and info.file_type == "BF16"
    assert model.config["file_type"] == "BF16" and model.config["model_type"] == human_number(info.parameter_count)
    assert not [p for p in store.root.iterdir() if p.name.startswith(".create-")]  # work folder removed


def test_create_from_existing_model_merges_parameters_and_shares_weights(store, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create(store, "base", "FROM ./tiny.gguf\nPARAMETER diffusion_steps 16\nPARAMETER seed 7\nSYSTEM base\nMESSAGE user a\n", tmp_path)
    events = create(store, "child", "FROM base\nPARAMETER diffusion_steps 32\nLICENSE extra\n", tmp_path)
    base, child = store.resolve("base"), store.resolve("child")
    assert child.parameters == {"diffusion_steps": 32, "seed": 7}  # new keys win, others inherited
    assert child.system == "base" and child.messages == base.messages and child.license == ["extra"]
    assert child.gguf_path == base.gguf_path
    model_layer = child.manifest.layer(MEDIA_MODEL)
    assert model_layer.from_ == "base:latest"
    assert f"using existing layer {model_layer.digest}" in [e["status"] for e in events]


def test_create_from_missing_model_pulls_it_first(store, tmp_path, monkeypatch):
    blob = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    with FakeRegistry() as reg:
        reg.add_model("library/remote:latest", [(MEDIA_MODEL, blob)])
        monkeypatch.setenv("DGEMMA_REGISTRY_MIRRORS", f"registry.ollama.ai={reg.url}")
        monkeypatch.setattr(PullOptions, "from_env", classmethod(lambda cls: PullOptions(part_size=512, backoff=0.01,
                                                                                          free_disk_margin=0)))
        events = create(store, "mine", "FROM remote\nPARAMETER diffusion_steps 8\n", tmp_path)
    assert events[0] == {"status": "pulling manifest"}
    assert sorted(m.name for m in store.list_models()) == ["mine:latest", "remote:latest"]


@pytest.mark.parametrize("text,message", [
    ("FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", "^adapter not found: ./lora.gguf$"),
    ("FROM ./tiny.gguf\nPARAMETER diffusion_steps 0\n", "invalid value for diffusion_steps: 0"),
    ("FROM ./tiny.gguf\nTEMPLATE \"{% for m in messages %}{{ m.content.__class__.__mro__[1].__subclasses__() }}{% endfor %}\"\n",
     "^template error: SecurityError"),
    ("FROM ./tiny.gguf\nTEMPLATE \"{% for i in range(10**9) %}{{ messages }}{% endfor %}\"\n", "^template error"),
    ("FROM ./notes.txt\n", r"^supplied file was not in GGUF format \(invalid GGUF: bad magic"),
    ("FROM ./llama.gguf\n", '^model architecture "llama" is not supported by dgemma$'),
    ("FROM ./tiny.gguf\n", "^quantization is only supported from F32, F16 or BF16 models$"),
])
def test_create_errors_leave_no_model(store, tmp_path, text, message):
    write_tiny_gguf(tmp_path / "tiny.gguf", file_type=7 if "quantiz" in message else 0)
    write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DgemmaError, match=message):
        create(store, "m", text, tmp_path, quantize="q4_K_M" if "quantiz" in message else None)
    assert not store.list_models()


def test_jinja_template_is_accepted_and_marked(store, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create(store, "j", 'FROM ./tiny.gguf\nTEMPLATE """{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"""\n', tmp_path)
    assert store.resolve("j").config["template_format"] == "jinja"


def test_recreating_a_name_removes_layers_only_it_used(store, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create(store, "m", "FROM ./tiny.gguf\nSYSTEM first\n", tmp_path)
    old_system = store.read_manifest("m").layer(MEDIA_SYSTEM).digest
    create(store, "m", "FROM ./tiny.gguf\nSYSTEM second\n", tmp_path)
    assert not store.has_blob(old_system)
    assert store.resolve("m").system == "second"


def test_server_style_create_never_opens_paths_outside_blobs(store, tmp_path):
    secret = write_tiny_gguf(tmp_path / "secret.gguf")
    store.ensure_dirs()
    for source in (str(secret), "../../secret.gguf", "/etc/passwd"):
        with pytest.raises(DgemmaError, match="^invalid model name$"):
            create(store, "m", f"FROM {source}\n", store.blobs_dir)
    assert not store.list_models() and not any(store.blobs_dir.iterdir())


def test_create_from_a_blob_path_references_it_without_copying(store, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create(store, "a", "FROM ./tiny.gguf\n", tmp_path)
    blob = store.resolve("a").gguf_path
    before = sorted(store.blobs_dir.iterdir())
    events = create(store, "b", f"FROM {blob.name}\n", store.blobs_dir)
    assert f"using existing layer sha256:{blob.name[7:]}" in [e["status"] for e in events]
    assert store.resolve("b").gguf_path == blob
    assert len(sorted(store.blobs_dir.iterdir())) == len(before)  # the config blob is shared too


@pytest.mark.parametrize("quantize,file_type", [("q8_0", "Q8_0"), ("q4_K_M", "Q4_K_M")])
def test_create_from_checkpoint_with_quantize(store, tmp_path, quantize, file_type):
    create(store, "tiny-q", f"FROM {FIXTURES / 'tiny-a'}\n", tmp_path, quantize=quantize)
    model = store.resolve("tiny-q")
    assert model.config["file_type"] == file_type
    assert read_gguf_info(model.gguf_path).file_type == file_type


def test_create_from_converted_fixture_gguf(store, tmp_path, gguf_path):
    gguf = gguf_path("tiny-a", "f32")
    create(store, "tiny-a-f32", f"FROM {gguf}\n", tmp_path)
    model = store.resolve("tiny-a-f32")
    info = read_gguf_info(model.gguf_path)
    assert model.gguf_path.read_bytes() == gguf.read_bytes()
    assert model.config["file_type"] == "F32" and model.config["model_type"] == human_number(info.parameter_count)
    assert info.metadata["diffusion.canvas_length"] > 0


def test_create_quantizes_a_float_gguf(store, tmp_path, gguf_path):
    events = create(store, "tiny-q8", f"FROM {gguf_path('tiny-a', 'f32')}\n", tmp_path, quantize="q8_0")
    progress = [e for e in events if e.get("total")]
    assert {"status": "quantizing F32 model to Q8_0"} in events
    assert progress and progress[-1]["status"] == "quantizing F32 model to Q8_0"
    assert [e["completed"] for e in progress] == sorted(e["completed"] for e in progress)
    model = store.resolve("tiny-q8")
    assert model.config["file_type"] == "Q8_0" and read_gguf_info(model.gguf_path).file_type == "Q8_0"


def test_converter_failure_is_a_clean_create_error(store, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(DgemmaError) as exc:
        create(store, "broken", "FROM ./ckpt\n", tmp_path)
    assert str(exc.value).startswith("converting model failed: ")
    assert str(tmp_path) not in str(exc.value) and not store.list_models()


def test_unreadable_source_is_a_clean_error(store, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf.chmod(0)
    if os.access(gguf, os.R_OK):  # running as root: make it a directory-shaped failure instead
        gguf.unlink()
        (tmp_path / "tiny.gguf").mkdir()
        (tmp_path / "tiny.gguf" / "a.gguf").mkdir()  # a folder whose only ".gguf" entry is not a file
    with pytest.raises(DgemmaError) as exc:
        create(store, "m", "FROM ./tiny.gguf\n", tmp_path)
    assert str(tmp_path) not in str(exc.value) and not store.list_models()
