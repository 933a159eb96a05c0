"""Store library (list, resolve, copy, delete, prune, case-insensitive names) and the `dgemma` store commands run
as subprocesses with DGEMMA_MODELS pointing at a temporary folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dgemma_cli.create import create_model
from dgemma_cli.errors import DgemmaError
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.store import MEDIA_MODEL, Store, sha256_file
from dgemma_cli.ui import human_bytes, human_duration
from cli_helpers import cli_env, in_process
from store_helpers import write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent


def make_model(store: Store, tmp_path: Path, name: str, extra: str = "") -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    list(create_model(name, parse_modelfile(f"FROM ./tiny.gguf\n{extra}"), store, tmp_path))


def test_layout_and_case_insensitive_lookup_reuses_disk_spelling(tmp_path):
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "hf.co/User/Repo:Q4_K_M")
    assert (store.root / "manifests/hf.co/User/Repo/Q4_K_M").is_file()
    assert store.resolve("HF.CO/user/repo:q4_k_m").name == "hf.co/User/Repo:Q4_K_M"
    assert store.manifest_path("hf.co/user/REPO:q4_k_m") == store.root / "manifests/hf.co/User/Repo/Q4_K_M"


def test_list_entries(tmp_path):
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "a")
    time.sleep(0.02)
    make_model(store, tmp_path, "b", "SYSTEM x\n")
    entries = store.list_models()
    assert [e.name for e in entries] == ["b:latest", "a:latest"]  # newest first
    manifest = store.read_manifest("a")
    a = entries[1]
    assert a.digest == manifest.digest and a.size == manifest.total_size
    assert a.details["family"] == "diffusion-gemma" and a.details["quantization_level"] == "F32"


def test_copy_shares_blobs_and_delete_prunes_only_unreferenced(tmp_path):
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "a", "SYSTEM only-a\n")
    store.copy("a", "b")
    assert store.read_manifest("b").raw == store.read_manifest("a").raw
    gguf_digest = store.read_manifest("a").layer(MEDIA_MODEL).digest
    assert store.delete("a") == []  # b still references everything
    removed = store.delete("b")
    assert gguf_digest in removed and not store.has_blob(gguf_digest)
    assert not any(store.manifests_dir.iterdir())  # empty manifest folders removed
    with pytest.raises(DgemmaError, match="^model 'a:latest' not found$"):
        store.delete("a")
    with pytest.raises(DgemmaError, match="^model 'nope:latest' not found$"):
        store.copy("nope", "x")


def test_copy_over_an_existing_model_prunes_the_blobs_only_it_used(tmp_path):
    """As a create over a model does: the layers only the replaced model had go, shared ones stay."""
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "a", "SYSTEM only-a\n")
    make_model(store, tmp_path, "b", "SYSTEM only-b\nPARAMETER seed 7\n")
    make_model(store, tmp_path, "c", "SYSTEM only-b\n")  # shares b's system layer
    b_only = set(store.read_manifest("b").all_digests()) - set(store.read_manifest("a").all_digests())
    shared = set(store.read_manifest("c").all_digests()) & b_only
    assert b_only and shared
    removed = store.copy("a", "b")
    assert removed == b_only
    assert store.read_manifest("b").raw == store.read_manifest("a").raw
    assert all(store.has_blob(d) for d in shared)  # c still uses them
    assert not any(store.has_blob(d) for d in b_only - shared)
    on_disk = {"sha256:" + p.name.removeprefix("sha256-") for p in store.blobs_dir.iterdir()}
    assert on_disk == store.referenced_digests()  # nothing unreferenced is left behind
    assert store.copy("a", "A") == set()  # onto itself (another spelling): nothing to prune


def deep_root(tmp_path: Path, length: int) -> Path:
    """A store folder whose path is about `length` bytes long (components of 200 bytes)."""
    root = tmp_path
    while len(str(root)) < length - 201:
        root = root / ("d" * 200)
    root.mkdir(parents=True)
    return root / "store"


def test_a_valid_name_too_long_for_a_deep_store_root_is_a_clean_error(tmp_path):
    """A name's path below a root near PATH_MAX (4096) fails with ENAMETOOLONG: a lookup finds nothing, a write is
    the invalid name error (400), never an OSError."""
    store = Store(deep_root(tmp_path, 3850))
    store.ensure_dirs()
    name = "h" * 255 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80
    assert not store.exists(name)
    with pytest.raises(DgemmaError, match="^model '.*' not found$") as missing:
        store.read_manifest(name)
    assert missing.value.status == 404
    make_model(store, tmp_path, "short")
    with pytest.raises(DgemmaError, match="^invalid model name$") as refused:
        store.copy("short", name)
    assert refused.value.status == 400
    with pytest.raises(DgemmaError, match="^model '.*' not found$"):
        store.delete(name)
    assert [entry.name for entry in store.list_models()] == ["short:latest"]


def test_prune_respects_age_and_references(tmp_path):
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "a")
    orphan_old = store.blobs_dir / ("sha256-" + "1" * 64)
    orphan_new = store.blobs_dir / ("sha256-" + "2" * 64)
    junk_old = store.blobs_dir / "sha256-junk-partial-0"
    for p in (orphan_old, orphan_new, junk_old):
        p.write_bytes(b"x")
    old = time.time() - 7200
    for p in (orphan_old, junk_old, *store.blobs_dir.glob("sha256-*")):
        os.utime(p, (old, old))
    os.utime(orphan_new, None)
    removed = store.prune(min_age_s=3600)
    assert sorted(removed) == sorted([orphan_old.name, junk_old.name])
    assert orphan_new.exists() and store.resolve("a").gguf_path.exists()


def test_legacy_colon_blob_names_are_renamed_by_prune(tmp_path):
    store = Store(tmp_path / "store")
    make_model(store, tmp_path, "a")
    path = store.resolve("a").gguf_path
    legacy = path.with_name(path.name.replace("sha256-", "sha256:"))
    path.rename(legacy)
    store.prune(min_age_s=3600)
    assert path.exists() and not legacy.exists()


@pytest.mark.parametrize("n,text", [(0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (4_700_000_000, "4.7 GB"),
                                    (16_912_345_678, "16 GB"), (986_000_000, "986 MB"), (1_000_000_000, "1 GB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("s,text", [(0.2, "Less than a second"), (1, "1 second"), (59, "59 seconds"), (60, "About a minute"),
                                    (150, "2 minutes"), (3600, "About an hour"), (5 * 3600, "5 hours"),
                                    (3 * 86400, "3 days"), (20 * 86400, "2 weeks"), (90 * 86400, "3 months"),
                                    (800 * 86400, "2 years")])
def test_human_duration(s, text):
    assert human_duration(s) == text


# ---- CLI as a subprocess -------------------------------------------------------------------------------------------

def dgemma(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **cli_env(tmp_path), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or tmp_path, timeout=60)


def test_cli_create_list_show_cp_rm(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "Modelfile").write_text('FROM ./tiny.gguf\nPARAMETER diffusion_steps 16\nPARAMETER stop "<end>"\n'
                                        'SYSTEM """Line one.\nLine two.\nLine three."""\nLICENSE MIT\n')
    r = dgemma(tmp_path, "create", "demo")
    assert r.returncode == 0, r.stderr
    assert "writing manifest" in r.stderr and "success" in r.stderr and r.stdout == ""

    # The remaining commands run in-process through the same entry point (a new interpreter costs seconds).
    env = cli_env(tmp_path)
    code, out, err = in_process(env, "list")
    lines = out.splitlines()
    assert (code, err) == (0, "") and lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    digest = Store(tmp_path / "store").read_manifest("demo").digest
    assert lines[1].startswith("demo:latest    ") and f"    {digest[:12]}    " in lines[1]
    assert lines[1].rstrip().endswith("ago") and " KB    " in lines[1]

    code, out, err = in_process(env, "show", "demo")
    assert (code, err) == (0, "")
    assert "  Model\n    architecture        diffusion-gemma\n" in out
    assert "    quantization        F32\n" in out and "    context length      64\n" in out
    assert "  Diffusion\n    canvas length           16\n    max denoising steps     16\n" in out
    assert "    temperature schedule    0.8 → 0.4\n" in out
    assert "  System\n    Line one.\n    Line two.\n    ...\n" in out
    assert "  Parameters\n    diffusion_steps    16\n    stop               \"<end>\"\n" in out

    code, out, _ = in_process(env, "show", "demo", "--modelfile")
    blob = Store(tmp_path / "store").blob_path(sha256_file(gguf))
    assert code == 0 and out.startswith('# Modelfile generated by "dgemma show"\n')
    assert f"\nFROM {blob}\n" in out and "\nPARAMETER stop <end>\n" in out
    code, out, err = in_process(env, "show", "demo", "--parameters")  # the server's text: keys in 30 columns
    assert (code, err) == (0, "") and re.fullmatch(r'diffusion_steps {1,16}16\nstop {1,27}"<end>"\n', out)
    first, second = out.splitlines()
    assert first.index("16") == second.index('"') >= 30  # values aligned after the key column
    assert in_process(env, "show", "demo", "--license") == (0, "MIT\n", "")
    assert in_process(env, "show", "demo", "--system") == (0, "Line one.\nLine two.\nLine three.\n", "")
    assert in_process(env, "show", "demo", "--license", "--system") == (
        1, "", "Error: only one of '--license', '--modelfile', '--parameters', '--system', or '--template' can be specified\n")
    verbose = in_process(env, "show", "demo", "-v")[1]
    assert re.search(r"\n  Tensors\n    token_embd\.weight +F32 +\[8, 16\]\n", verbose)  # name, type, shape columns
    assert re.search(r"\n    tokenizer\.ggml\.tokens +\[\.\.\. 16 items\]\n", verbose)  # long arrays as a count

    assert in_process(env, "cp", "demo", "other/copy:v1") == (0, "copied 'demo' to 'other/copy:v1'\n", "")
    code, out, _ = in_process(env, "ls", "OTHER")
    assert [line.split()[0] for line in out.splitlines()] == ["NAME", "other/copy:v1"]
    assert in_process(env, "rm", "demo", "other/copy:v1") == (0, "deleted 'demo'\ndeleted 'other/copy:v1'\n", "")
    assert not [p for p in (tmp_path / "store" / "blobs").iterdir()]
    assert in_process(env, "list")[1].strip() == "NAME    ID    SIZE    MODIFIED"


@pytest.mark.parametrize("args,message", [
    (("show", "missing"), "Error: model 'missing' not found\n"),
    (("rm", "missing"), "Error: model 'missing' not found\n"),  # the server's /api/delete text (name as sent)
    (("create", "bad/../name"), "Error: invalid model name: bad/../name\n"),
    (("cp", "../x", "y"), 'Error: source "../x" is invalid\n'),
    (("cp", "x", "a/b/c/d"), 'Error: destination "a/b/c/d" is invalid\n'),
    (("create", "m", "-f", "nope"), "Error: Modelfile not found: nope\n"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert in_process(cli_env(tmp_path), *args) == (1, "", message)


def test_cli_modelfile_error_has_line_number(tmp_path):
    (tmp_path / "Modelfile").write_text("FROM x\nNOPE y\n")
    r = dgemma(tmp_path, "create", "m")
    assert r.returncode == 1 and r.stderr.startswith("Error: (line 2): command must be one of")
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_cli_pull_through_mirror(tmp_path):
    from registry_server import FakeRegistry

    blob = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    with FakeRegistry() as reg:
        reg.add_model("unsloth/tiny-GGUF:Q4_K_M", [(MEDIA_MODEL, blob)])
        env_extra = {"DGEMMA_REGISTRY_MIRRORS": f"hf.co={reg.url}", "DGEMMA_PULL_BACKOFF": "0.01"}
        env = {**os.environ, **cli_env(tmp_path), **env_extra}
        r = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "pull", "hf.co/unsloth/tiny-GGUF:Q4_K_M"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == "pulling manifest" and "success" in r.stderr
    assert json.loads((tmp_path / "store/manifests/hf.co/unsloth/tiny-GGUF/Q4_K_M").read_bytes())["layers"][0]["size"] == len(blob)


# ---- progress rendering --------------------------------------------------------------------------------------------

def test_bar_line_and_remaining_time():
    from dgemma_cli.ui import bar_line, remaining_text

    line = bar_line("pulling 8eeb52dfb3bb", 2_115_000_000, 4_700_000_000, 12_000_000, 100)
    assert line.startswith("pulling 8eeb52dfb3bb:  45% ▕") and line.endswith("▏ 2.1 GB/4.7 GB  12 MB/s  3m35s")
    assert len(line) == 100 and line.count("█") == (100 - len("pulling 8eeb52dfb3bb:  45% ") - len("2.1 GB/4.7 GB  12 MB/s  3m35s") - 3) * 45 // 100
    done = bar_line("pulling x", 5, 5, 0, 40)
    assert done.startswith("pulling x: 100% ▕█") and done.endswith("█▏ 5 B")
    assert [remaining_text(s) for s in (45, 123, 3900, 10**7)] == ["45s", "2m3s", "1h5m", "99h+"]


def test_progress_renderer_terminal_frame():
    import io

    from rich.console import Console

    from dgemma_cli.ui import ProgressRenderer

    console = Console(file=io.StringIO(), force_terminal=True, width=90)
    r = ProgressRenderer(console)
    d = "sha256:" + "8eeb52dfb3bb" + "0" * 52
    for event in [{"status": "pulling manifest"}, {"status": "pulling 8eeb52dfb3bb", "digest": d, "total": 1000},
                  {"status": "pulling 8eeb52dfb3bb", "digest": d, "total": 1000, "completed": 500},
                  {"status": "verifying sha256 digest"}]:
        r.update(event)
    lines = r.render().plain.splitlines()
    assert lines[0] == "pulling manifest"
    assert lines[1].startswith("pulling 8eeb52dfb3bb:  50% ▕") and "500 B/1 KB" in lines[1]
    assert lines[2] == "verifying sha256 digest" and len(lines) == 3  # no spinner before the live display starts


def test_a_stored_messages_layer_no_template_can_render_is_refused_in_one_line(tmp_path):
    """A model stored before create and pull checked messages (or written by hand) answers a 400 naming the layer,
    not an error from inside the renderer."""
    from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_MESSAGES, MEDIA_MODEL, Layer, Store, build_manifest,
                                  canonical_json)
    from dgemma_engine.errors import DgemmaError

    store = Store(tmp_path / "models")
    model = store.write_blob(b"GGUF not really")
    config = store.write_blob(canonical_json({"model_format": "gguf", "model_family": "diffusion-gemma"}))
    for messages, ok in (([{"role": "user", "content": "hi"}], True), ([1, "x", {"role": "wizard"}], False)):
        layers = [Layer(MEDIA_MODEL, *model), Layer(MEDIA_MESSAGES, *store.write_blob(canonical_json(messages)))]
        store.write_manifest("m", build_manifest(Layer(CONFIG_MEDIA_TYPE, *config), layers))
        if ok:
            assert store.resolve("m").messages == messages
            continue
        with pytest.raises(DgemmaError) as caught:
            store.resolve("m")
        assert caught.value.status == 400
        assert str(caught.value) == ("the model's messages layer is invalid: messages[0]: a message is an object "
                                     'with "role" and "content"')
