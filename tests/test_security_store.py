"""Security checklist of docs/compat.md#security-checklist, sections A–E, as far as the store, pull, create and the GGUF
gate are concerned (the REST endpoints' own checks live with the server tests)."""
from __future__ import annotations

import gzip
import json
import os
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from dgemma_cli.create import create_model
from dgemma_cli.errors import DgemmaError
from dgemma_cli.gguf_check import GGUFError, check_diffusion_gguf, parse_gguf, read_gguf_info
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.names import ModelName
from dgemma_cli.registry import PullOptions, pull, registry_endpoint
from dgemma_cli.store import MEDIA_MODEL, Store
from registry_server import FakeRegistry, digest_of
from store_helpers import gstr, kv_str, kv_u32, raw_gguf, tensor_info, tiny_gguf_bytes, valid_raw_gguf

HEX = "ab" * 32


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def opts(**kw) -> PullOptions:
    base = dict(part_size=256, streams=2, stall_timeout=2.0, retries=1, backoff=0.01, free_disk_margin=0,
                progress_interval=0.005)
    base.update(kw)
    return PullOptions(**base)


# ---- A. one digest -> path function --------------------------------------------------------------------------------

@pytest.mark.parametrize("digest", [
    "", "../x", "sha256:../../outside", "sha256:" + "a" * 63, "sha256:" + "a" * 65, f"sha256-{HEX}/../x",
    f"sha256:{HEX}\x00", "/etc/passwd", f"sha256:{HEX[:-1]}\\", "sha256:" + "\u0661" * 64, "sha512:" + HEX,
    HEX, f"sha256:{HEX} ", f" sha256:{HEX}", "sha256:" + "g" * 64, None, 123,
])
def test_blob_path_rejects(tmp_path, digest):
    with pytest.raises(DgemmaError, match="^invalid digest format$"):
        Store(tmp_path).blob_path(digest)


def test_blob_path_accepts_both_separators_and_lowercases(tmp_path):
    store = Store(tmp_path)
    upper = "sha256:" + HEX.upper()
    assert store.blob_path(upper) == tmp_path / "blobs" / f"sha256-{HEX}"
    assert store.blob_path(f"sha256-{HEX}") == tmp_path / "blobs" / f"sha256-{HEX}"
    assert store.partial_path(upper).name == f"sha256-{HEX}-partial"
    assert store.sidecar_path(upper, 3).name == f"sha256-{HEX}-partial-3"


def test_blob_path_refuses_a_symlink_out_of_blobs(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure_dirs()
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.blobs_dir / f"sha256-{HEX}").symlink_to(outside / "secret")
    with pytest.raises(DgemmaError, match="invalid digest format"):
        store.blob_path("sha256:" + HEX)


@pytest.mark.parametrize("bad_digest", ["sha256:../../../outside", "sha256-" + "a" * 63, f"sha256:{HEX}/../../x"])
@pytest.mark.parametrize("where", ["layer", "config"])
def test_traversal_digest_in_a_pulled_manifest_is_refused_before_any_write(reg, tmp_path, bad_digest, where):
    store = Store(tmp_path / "store")
    good = {"mediaType": MEDIA_MODEL, "digest": "sha256:" + HEX, "size": 10}
    bad = {"mediaType": MEDIA_MODEL, "digest": bad_digest, "size": 10}
    manifest = {"schemaVersion": 2, "config": bad if where == "config" else good, "layers": [bad if where == "layer" else good]}
    reg.set_manifest("library", "m", "latest", json.dumps(manifest).encode())
    before = snapshot(tmp_path)
    with pytest.raises(DgemmaError, match="invalid digest"):
        list(pull(f"{reg.host}/library/m", store, insecure=True, options=opts()))
    assert snapshot(tmp_path) == before
    assert [r.path for r in reg.log] == ["/v2/library/m/manifests/latest"]


def test_digest_mismatch_cleanup_touches_only_validator_paths(reg, tmp_path):
    blob = tiny_gguf_bytes(tmp_path)
    digest = digest_of(blob)
    store = Store(tmp_path / "store")
    store.ensure_dirs()
    bystanders = [store.blobs_dir / "unrelated-file", tmp_path / f"sha256-{digest[7:]}-partial"]
    for p in bystanders:
        p.write_bytes(b"keep me")
    raw = reg.add_model("library/m:latest", [(MEDIA_MODEL, blob)])
    config_digest = json.loads(raw)["config"]["digest"]
    reg.faults.corrupt = {digest}
    with pytest.raises(DgemmaError, match="digest mismatch"):
        list(pull(f"{reg.host}/library/m", store, insecure=True, options=opts()))
    assert all(p.read_bytes() == b"keep me" for p in bystanders)
    # Only the (verified) config blob was added; the bad layer's partial and sidecars are gone.
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == sorted(["unrelated-file", f"sha256-{config_digest[7:]}"])


# ---- B. names ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../etc/passwd", "ns/../m", "m:a/b", "a\\b", ".m", "-m", "x" * 81, "a/b/c/d",
                                  "h" * 256 + "/ns/m", "h" * 300 + "/ns/m", "h" * 350 + "/library/m:latest"])
def test_invalid_names_on_every_store_operation(tmp_path, name):
    store = Store(tmp_path / "store")
    store.ensure_dirs()
    before = snapshot(tmp_path)
    operations = [
        lambda: store.manifest_path(name), lambda: store.read_manifest(name), lambda: store.resolve(name),
        lambda: store.write_manifest(name, b"{}"), lambda: store.delete(name), lambda: store.copy(name, "ok"),
        lambda: store.copy("ok", name), lambda: list(create_model(name, parse_modelfile("FROM x"), store, tmp_path)),
        lambda: list(pull(name, store)),
    ]
    for op in operations:
        with pytest.raises(DgemmaError) as exc:
            op()
        assert str(exc.value) in ("invalid model name", "model 'ok:latest' not found")
    assert snapshot(tmp_path) == before


def test_same_error_whether_or_not_a_similar_file_exists(tmp_path):
    store = Store(tmp_path / "store")
    (store.manifests_dir / "registry.ollama.ai" / "library" / "..m").mkdir(parents=True)
    (store.manifests_dir / "registry.ollama.ai" / "library" / "..m" / "latest").write_text("{}")
    messages = set()
    for name in ("..m", "..n"):
        with pytest.raises(DgemmaError) as exc:
            store.resolve(name)
        messages.add(str(exc.value))
    assert messages == {"invalid model name"}


def test_manifest_path_symlinked_outside_is_refused(tmp_path):
    store = Store(tmp_path / "store")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.manifests_dir / "registry.ollama.ai").mkdir(parents=True)
    (store.manifests_dir / "registry.ollama.ai" / "library").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DgemmaError, match="invalid model name"):
        store.write_manifest("m", b'{"schemaVersion":2,"config":{"mediaType":"x","digest":"sha256:' + HEX.encode() + b'","size":1},"layers":[]}')
    assert not list(outside.iterdir())


# ---- C. no path leaks ----------------------------------------------------------------------------------------------

def test_error_messages_never_contain_the_store_root(tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    store.ensure_dirs()
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\xff" * 40)
    messages = []
    for op in (
        lambda: store.resolve("missing"),
        lambda: store.delete("missing"),
        lambda: list(create_model("m", parse_modelfile(f"FROM {bad_gguf}"), store, tmp_path)),
        lambda: check_diffusion_gguf(bad_gguf),
        lambda: read_gguf_info(tmp_path / "nope.gguf"),
    ):
        with pytest.raises(DgemmaError) as exc:
            op()
        messages.append(str(exc.value))
    assert all(str(tmp_path) not in m and os.path.expanduser("~") not in m for m in messages), messages


# ---- D. GGUF hardening ---------------------------------------------------------------------------------------------

def _corpus() -> dict[str, bytes]:
    arch = kv_str("general.architecture", "diffusion-gemma")
    canvas = kv_u32("diffusion.canvas_length", 16)
    good = valid_raw_gguf()
    head = b"GGUF" + struct.pack("<I", 3)
    return {
        "empty": b"", "one byte": b"G", "four bytes": b"GGUF", "magic only": b"GGUF", "bad magic": b"GGML" + good[4:],
        "bad version": b"GGUF" + struct.pack("<I", 99) + good[8:],
        "version 1": b"GGUF" + struct.pack("<I", 1) + good[8:],
        "truncated kv section": good[:40],
        "n_tensors 2^63": head + struct.pack("<QQ", 1 << 63, 0),
        "n_kv 2^63": head + struct.pack("<QQ", 0, 1 << 63),
        "n_kv 2^64-1": head + struct.pack("<QQ", 0, (1 << 64) - 1),
        "string length beyond EOF": raw_gguf([gstr("general.architecture") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40)], []),
        "key length beyond EOF": raw_gguf([struct.pack("<Q", 1 << 62)], []),
        "array length beyond EOF": raw_gguf([gstr("a") + struct.pack("<IIQ", 9, 4, 1 << 60)], []),
        "string array beyond EOF": raw_gguf([gstr("a") + struct.pack("<IIQ", 9, 8, 1 << 40)], []),
        "nested arrays": raw_gguf([gstr("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + b"\0" * 4], []),
        "unknown value type": raw_gguf([gstr("a") + struct.pack("<I", 77) + b"\0" * 8], []),
        "alignment 0": raw_gguf([arch, canvas, gstr("general.alignment") + struct.pack("<II", 4, 0)], [tensor_info("t", (8,))], b"\0" * 64),
        "alignment 48": raw_gguf([arch, canvas, gstr("general.alignment") + struct.pack("<II", 4, 48)], [tensor_info("t", (8,))], b"\0" * 64),
        "n_dims 5": raw_gguf([arch, canvas], [tensor_info("t", (1, 1, 1, 1, 8))], b"\0" * 64),
        "n_dims 0": raw_gguf([arch, canvas], [tensor_info("t", (), n_dims=0)], b"\0" * 64),
        "dimension 0": raw_gguf([arch, canvas], [tensor_info("t", (8, 0))], b"\0" * 64),
        "overflowing dims": raw_gguf([arch, canvas], [tensor_info("t", (1 << 32, 1 << 32, 1 << 32))], b"\0" * 64),
        "unknown ggml type": raw_gguf([arch, canvas], [tensor_info("t", (8,), ggml_type=99)], b"\0" * 64),
        "row not multiple of block": raw_gguf([arch, canvas], [tensor_info("t", (33,), ggml_type=8)], b"\0" * 64),
        "duplicate tensor names": raw_gguf([arch, canvas], [tensor_info("t", (8,)), tensor_info("t", (8,), offset=32)], b"\0" * 64),
        "duplicate keys": raw_gguf([arch, arch, canvas], [], b""),
        "offset+size beyond EOF": raw_gguf([arch, canvas], [tensor_info("t", (8,), offset=1 << 40)], b"\0" * 32),
        "data beyond EOF": raw_gguf([arch, canvas], [tensor_info("t", (1024,))], b"\0" * 32),
        "unaligned offset": raw_gguf([arch, canvas], [tensor_info("t", (8,), offset=4)], b"\0" * 64),
        "overlapping tensors": raw_gguf([arch, canvas], [tensor_info("a", (16,)), tensor_info("b", (16,), offset=32)], b"\0" * 128),
        "tensor name too long": raw_gguf([arch, canvas], [tensor_info("x" * 200, (8,))], b"\0" * 64),
        "block_count as string": raw_gguf([arch, canvas, kv_str("diffusion-gemma.block_count", "30")], []),
        "context_length as float": raw_gguf([arch, canvas, gstr("diffusion-gemma.context_length") + struct.pack("<If", 6, 1.5)], []),
        "canvas_length as string": raw_gguf([arch, kv_str("diffusion.canvas_length", "256")], []),
        "canvas_length zero": raw_gguf([arch, kv_u32("diffusion.canvas_length", 0)], []),
        "architecture as int": raw_gguf([kv_u32("general.architecture", 7), canvas], []),
        "bool value 2": raw_gguf([arch, canvas, gstr("b") + struct.pack("<IB", 7, 2)], []),
        "invalid utf-8 key": raw_gguf([arch, canvas, gstr(b"\xff\xfe") + struct.pack("<II", 4, 1)], []),
    }


CORPUS = _corpus()


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_gguf_fuzz_corpus_is_rejected_quickly_with_bounded_memory(tmp_path, case):
    path = tmp_path / "case.gguf"
    path.write_bytes(CORPUS[case])
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(GGUFError):
            check_diffusion_gguf(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - started < 1.0
    assert peak < 1 << 20  # bounded by the (tiny) file, whatever its header claims


def test_valid_raw_gguf_passes_and_large_arrays_are_summarised(tmp_path):
    info = parse_gguf(valid_raw_gguf())
    assert info.architecture == "diffusion-gemma" and [t.name for t in info.tensors] == ["a.weight"]
    big = raw_gguf([kv_str("general.architecture", "diffusion-gemma"), gstr("tokens") + struct.pack("<IIQ", 9, 8, 5000)
                    + b"".join(gstr(f"t{i}") for i in range(5000))], [])
    summary = parse_gguf(big).metadata["tokens"]
    assert summary.length == 5000 and summary.item_type == 8


def test_release_sized_vocabulary_header_is_checked_quickly():
    """A 26B-like header (262144 tokens, 514906 merges) is stepped over, not decoded: well under a second."""
    tokens = b"".join(gstr(f"tok{i}") for i in range(262144))
    merges = b"".join(gstr(f"a{i} b{i}") for i in range(514906))
    data = raw_gguf([kv_str("general.architecture", "diffusion-gemma"), kv_u32("diffusion.canvas_length", 256),
                     gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 262144) + tokens,
                     gstr("tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, 514906) + merges], [])
    started = time.monotonic()
    info = parse_gguf(data)
    assert time.monotonic() - started < 1.0
    assert info.metadata["tokenizer.ggml.merges"].length == 514906
    with pytest.raises(GGUFError, match="extends beyond the end"):
        parse_gguf(data[:-64])  # past the trailing alignment padding, into the merges


def test_wrong_architecture_is_refused_by_the_gate(tmp_path):
    path = tmp_path / "llama.gguf"
    path.write_bytes(tiny_gguf_bytes(tmp_path, arch="llama"))
    with pytest.raises(GGUFError, match='^model architecture "llama" is not supported by dgemma$'):
        check_diffusion_gguf(path)


def test_gate_refuses_non_regular_files_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf_info(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf_info(tmp_path)


# ---- E. registry client --------------------------------------------------------------------------------------------

@pytest.fixture
def reg(registry):
    return registry


def _pull(reg, store, name="library/m:latest", **kw):
    return list(pull(f"{reg.host}/{name}", store, insecure=True, options=opts(**kw)))


def test_huge_manifest_is_capped_even_without_content_length(reg, tmp_path):
    raw = b'{"schemaVersion":2,"layers":[' + b" " * (5 << 20) + b"]}"
    reg.set_manifest("library", "m", "latest", raw)
    reg.faults.manifest_chunks = 64  # streamed: no Content-Length to trust
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match="manifest is too large"):
        _pull(reg, store)
    assert not store.root.exists() or not snapshot(store.root)


def test_compressed_manifest_is_refused(reg, tmp_path):
    bomb = gzip.compress(b"{" + b" " * (50 << 20) + b"}")
    reg.set_manifest("library", "m", "latest", bomb)
    reg.faults.manifest_headers = {"Content-Encoding": "gzip"}
    with pytest.raises(DgemmaError, match="unexpected content encoding 'gzip'"):
        _pull(reg, Store(tmp_path / "store"))
    assert reg.log[0].headers.get("accept-encoding") == "identity"


@pytest.mark.parametrize("manifest,message", [
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2}}, "missing layers"),
    ({"schemaVersion": 1, "layers": []}, "schemaVersion"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": -1}, "layers": []}, "invalid size"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2},
      "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:" + "cd" * 32, "size": 10**13}]}, "invalid size"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2},
      "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:" + HEX, "size": 2}]}, "config digest repeats"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2},
      "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:" + "cd" * 32, "size": 1}] * 65}, "more than 64 layers"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2},
      "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:" + "cd" * 32, "size": 1}] * 50_000}, "manifest is too large"),
    ({"schemaVersion": 2, "config": {"mediaType": "c", "digest": "sha256:" + HEX, "size": 2},
      "layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 1}]},
     "no model layer"),
])
def test_hostile_manifests_give_clean_errors(reg, tmp_path, manifest, message):
    reg.set_manifest("library", "m", "latest", json.dumps(manifest).encode())
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match=message):
        _pull(reg, store)
    assert not store.list_models()
    assert all(r.path == "/v2/library/m/manifests/latest" for r in reg.log)  # nothing else was fetched


def test_token_response_is_capped(reg, tmp_path, monkeypatch):
    reg.add_model("library/m:latest", [(MEDIA_MODEL, tiny_gguf_bytes(tmp_path))])
    reg.faults.require_token = True
    reg.faults.token_body = b'{"token":"' + b"a" * (100 << 10) + b'"}'
    with pytest.raises(DgemmaError, match="token response is too large"):
        _pull(reg, Store(tmp_path / "store"))


def test_realm_on_another_host_is_refused_and_never_contacted(reg, tmp_path):
    reg.add_model("library/m:latest", [(MEDIA_MODEL, tiny_gguf_bytes(tmp_path))])
    reg.faults.require_token = True
    reg.faults.token_realm = f"http://127.0.0.2:{reg.cdn.port}/token"  # a different host
    with pytest.raises(DgemmaError, match="^unauthorized: realm host mismatch$"):
        _pull(reg, Store(tmp_path / "store"))
    assert not reg.cdn.log


def test_no_authorization_to_redirect_target_on_another_host(reg, tmp_path):
    blob = tiny_gguf_bytes(tmp_path)
    reg.add_model("library/m:latest", [(MEDIA_MODEL, blob)])
    reg.faults.require_token = True
    reg.faults.redirect_blobs_to = reg.cdn.url
    _pull(reg, Store(tmp_path / "store"))
    assert reg.cdn.requests_for(digest_of(blob))
    assert all("authorization" not in r.headers for r in reg.cdn.log)


def test_redirect_chain_limit(reg, tmp_path):
    blob = tiny_gguf_bytes(tmp_path)
    reg.add_model("library/m:latest", [(MEDIA_MODEL, blob)])
    reg.faults.redirect_hops = 10  # 1 + 10 redirects: one more than allowed
    with pytest.raises(DgemmaError, match="too many redirects"):
        _pull(reg, Store(tmp_path / "s1"))
    reg.faults.redirect_hops = 9  # exactly 10 redirects: allowed
    assert _pull(reg, Store(tmp_path / "s2"))[-1] == {"status": "success"}


@pytest.mark.parametrize("location", ["http://169.254.169.254/latest/meta-data", "http://10.1.2.3/x",
                                      "http://[::1]:9/x", "http://0.0.0.0:9/x"])
def test_redirect_to_internal_address_is_blocked(reg, tmp_path, location):
    reg.add_model("library/m:latest", [(MEDIA_MODEL, tiny_gguf_bytes(tmp_path))])
    reg.faults.redirect_location = location
    with pytest.raises(DgemmaError, match="resolves to a private or local address"):
        _pull(reg, Store(tmp_path / "store"))


def test_private_registry_host_needs_the_allow_list(tmp_path, monkeypatch):
    with FakeRegistry() as registry:
        monkeypatch.setenv("DGEMMA_REGISTRY_ALLOW", "")
        with pytest.raises(DgemmaError, match="DGEMMA_REGISTRY_ALLOW"):
            list(pull(f"{registry.host}/library/m", Store(tmp_path / "s"), insecure=True, options=opts()))
        assert not registry.log


def test_insecure_never_downgrades_https(monkeypatch):
    monkeypatch.delenv("DGEMMA_REGISTRY_MIRRORS", raising=False)
    # Open WebUI's request shape: {"model": "hf.co/...", "insecure": true}
    endpoint, _ = registry_endpoint(ModelName.parse("hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M"), insecure=True)
    assert endpoint.url("/v2/x") == "https://hf.co/v2/x"
    assert registry_endpoint(ModelName.parse("registry.ollama.ai/library/m"), insecure=True)[0].scheme == "https"
    assert registry_endpoint(ModelName.parse("127.0.0.1:5000/library/m"), insecure=False)[0].scheme == "https"
    assert registry_endpoint(ModelName.parse("127.0.0.1:5000/library/m"), insecure=True)[0].url("/") == "http://127.0.0.1:5000/"
    assert registry_endpoint(ModelName.parse("http://h.example/library/m"), insecure=False)[0].scheme == "https"
    assert registry_endpoint(ModelName.parse("http://h.example/library/m"), insecure=True)[0].scheme == "http"


def test_declared_size_mismatch_is_rejected(reg, tmp_path):
    blob = tiny_gguf_bytes(tmp_path)
    reg.add_model("library/m:latest", [(MEDIA_MODEL, blob)])
    manifest = json.loads(reg.manifests[("library", "m", "latest")])
    manifest["layers"][0]["size"] = len(blob) + 1000  # the registry will answer a different total
    reg.set_manifest("library", "m", "latest", json.dumps(manifest).encode())
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError):
        _pull(reg, store)
    assert not store.has_blob(digest_of(blob)) and not store.list_models()


# ---- property: hostile bytes never escape as anything but a clean error ------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dgemma_cli.gguf_check import GGUFInfo  # noqa: E402
from dgemma_cli.modelfile import ModelfileError  # noqa: E402

_VALID = valid_raw_gguf()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(_VALID)))
def test_mutated_gguf_headers_fail_cleanly(flips, cut):
    data = bytearray(_VALID)
    for pos, value in flips:
        data[pos] = value
    try:
        info = parse_gguf(bytes(data[:cut]))
    except GGUFError:
        return
    assert isinstance(info, GGUFInfo)
    assert all(t.offset + t.nbytes <= cut for t in info.tensors)


@settings(max_examples=200, deadline=None)
@given(st.text(st.sampled_from('FROMPARAMETERSYSTEMmessageuser "#\n\t\r:xyz0129.'), max_size=80))
def test_arbitrary_modelfile_text_fails_cleanly(text):
    try:
        parse_modelfile(text)
    except ModelfileError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_names_fail_cleanly(text):
    try:
        name = ModelName.parse(text)
    except DgemmaError as exc:
        assert str(exc) == "invalid model name"
        return
    assert all(part and ".." != part and "/" not in part[1:] for part in name.parts[1:])


def test_realm_host_rule():
    from dgemma_cli.registry import _same_auth_host

    assert _same_auth_host("HF.co", "hf.co") and _same_auth_host("huggingface.co", "hf.co")
    assert _same_auth_host("ollama.com", "registry.ollama.ai")
    assert not _same_auth_host("evil.example", "hf.co") and not _same_auth_host("hf.co.evil.example", "hf.co")
    assert not _same_auth_host("ollama.com", "hf.co") and not _same_auth_host("127.0.0.2", "127.0.0.1")


# ---- G. names that reach the file system, store consistency, read-only mode ---------------------------------------

LONG_HOSTS = [256, 300, 350]  # Ollama's grammar allows hosts up to 350 characters; a file name holds 255 bytes


def long_name_requests(name: str) -> list[tuple[str, str, dict | None, str]]:
    """(method, path, body, expected error) of every route that takes a model name."""
    messages = [{"role": "user", "content": "Hi"}]
    invalid = "invalid model name"
    return [
        ("POST", "/api/show", {"model": name}, invalid),
        ("POST", "/api/generate", {"model": name, "prompt": "Hi", "stream": False}, invalid),
        ("POST", "/api/chat", {"model": name, "messages": messages, "stream": False}, invalid),
        ("DELETE", "/api/delete", {"model": name}, invalid),
        ("POST", "/api/copy", {"source": name, "destination": "x"}, f'source "{name}" is invalid'),
        ("POST", "/api/copy", {"source": "tiny", "destination": name}, f'destination "{name}" is invalid'),
        ("POST", "/api/create", {"model": name, "from": "tiny", "stream": False}, invalid),
        ("POST", "/api/create", {"model": "x", "from": name, "stream": False}, invalid),
        ("POST", "/api/pull", {"model": name, "stream": False}, invalid),
        ("POST", "/api/embed", {"model": name, "input": "x"}, invalid),
        ("POST", "/v1/chat/completions", {"model": name, "messages": messages}, invalid),
        ("POST", "/v1/completions", {"model": name, "prompt": "Hi"}, invalid),
        ("GET", f"/v1/models/{name}", None, invalid),
    ]


@pytest.fixture(scope="module")
def served_store(tmp_path_factory, gguf_path):
    import hashlib

    import httpx
    from server_harness import ServeProcess

    root = tmp_path_factory.mktemp("served-store")
    with ServeProcess(root / "models") as server, httpx.Client(base_url=server.url, timeout=300) as client:
        data = gguf_path("tiny-a", "f32").read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        client.post(f"/api/blobs/{digest}", content=data).raise_for_status()
        created = client.post("/api/create", json={"model": "tiny", "files": {"tiny-a.gguf": digest},
                                                   "stream": False})
        assert created.status_code == 200, created.text
        yield server, client, root / "models"


def error_of(response) -> str:
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize("host_length", LONG_HOSTS)
def test_a_host_longer_than_a_file_name_is_an_invalid_name_on_every_route(served_store, host_length):
    """Once a 500 (ENAMETOOLONG from the store's lookup) on show, generate, chat, delete, copy and /v1."""
    import time

    server, client, models = served_store
    name = "h" * host_length + "/ns/m"
    before = snapshot(models / "manifests")
    for method, path, body, expected in long_name_requests(name):
        started = time.monotonic()
        response = client.request(method, path, json=body)
        assert (response.status_code, error_of(response)) == (400, expected), (path, response.text)
        assert time.monotonic() - started < 5
    assert snapshot(models / "manifests") == before and server.process.poll() is None
    assert "Traceback" not in server.logs() and "File name too long" not in server.logs()


def test_the_longest_valid_host_is_stored_copied_and_deleted(served_store):
    _, client, models = served_store
    name = "h" * 255 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80
    assert client.post("/api/copy", json={"source": "tiny", "destination": name}).status_code == 200
    shown = client.post("/api/show", json={"model": name})
    assert shown.status_code == 200 and shown.json()["details"]["family"] == "diffusion-gemma"
    assert client.request("DELETE", "/api/delete", json={"model": name}).status_code == 200
    assert client.post("/api/show", json={"model": name}).status_code == 404


def unreferenced_blobs(models: Path) -> set[str]:
    store = Store(models)
    on_disk = {"sha256:" + p.name.removeprefix("sha256-") for p in store.blobs_dir.iterdir()}
    return on_disk - store.referenced_digests()


def test_copy_onto_an_existing_model_prunes_its_layers_like_create(served_store):
    """Create over a model and delete already removed the layers nothing references any more; copy did not."""
    _, client, models = served_store
    created = client.post("/api/create", json={"model": "victim", "from": "tiny", "system": "only the victim's",
                                               "parameters": {"seed": 42}, "stream": False})
    assert created.status_code == 200, created.text
    victim_only = set(Store(models).read_manifest("victim").all_digests()) - set(
        Store(models).read_manifest("tiny").all_digests())
    assert len(victim_only) == 2  # its system and params layers (the config is the same as tiny's)
    assert unreferenced_blobs(models) == set()
    assert client.post("/api/copy", json={"source": "tiny", "destination": "victim"}).status_code == 200
    assert unreferenced_blobs(models) == set()
    assert not any(Store(models).has_blob(digest) for digest in victim_only)
    assert Store(models).read_manifest("victim").raw == Store(models).read_manifest("tiny").raw
    assert client.request("DELETE", "/api/delete", json={"model": "victim"}).status_code == 200


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its modification time and size (folders too)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size if p.is_file() else 0)
            for p in sorted(root.rglob("*"))}


def test_a_read_only_server_writes_nothing_in_the_models_folder(tmp_path, gguf_path):
    """Before: `/api/show` of the bundled `sudoku` registered it in the store, schema compiles wrote the automata
    cache, and the startup prune removed old unreferenced blobs."""
    import hashlib

    import httpx
    from server_harness import ServeProcess, add_model

    models = tmp_path / "models"
    store = Store(models)
    add_model(store, "tiny", gguf_path("tiny-a", "f32"))
    stale = store.blob_path("sha256:" + "e" * 64)
    stale.write_bytes(b"nothing references this")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # old enough for the startup prune
    before = files_of(models)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    options = {"num_predict": 8, "diffusion_steps": 2, "seed": 1}
    blob = b"an upload"
    requests = [
        ("POST", "/api/show", {"model": "sudoku"}, 200),
        ("POST", "/api/generate", {"model": "sudoku", "prompt": "0" * 81, "stream": False,
                                   "options": {"task_tries": 1}}, 200),
        ("POST", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False, "format": schema,
                                   "options": options}, 200),
        ("POST", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False, "format": schema,
                                   "options": options}, 200),  # from memory now
        ("POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "format": "json",
                               "stream": False, "options": options}, 200),
        ("GET", "/api/tags", None, 200),
        ("GET", "/api/ps", None, 200),
        ("POST", "/api/copy", {"source": "tiny", "destination": "t2"}, 403),
        ("DELETE", "/api/delete", {"model": "sudoku"}, 403),
        ("POST", "/api/pull", {"model": "sudoku", "stream": False}, 403),
        ("POST", "/api/create", {"model": "t3", "from": "tiny", "stream": False}, 403),
    ]
    with ServeProcess(models, {"DGEMMA_READONLY": "1"}) as server, \
            httpx.Client(base_url=server.url, timeout=300) as client:
        for method, path, body, status in requests:
            response = client.request(method, path, json=body)
            assert response.status_code == status, (path, response.text)
        upload = client.post("/api/blobs/sha256:" + hashlib.sha256(blob).hexdigest(), content=blob)
        assert upload.status_code == 403
        assert "sudoku:latest" not in {m["name"] for m in client.get("/api/tags").json()["models"]}
    assert files_of(models) == before


def test_a_read_only_server_does_not_bring_back_a_deleted_bundled_model(tmp_path):
    from dgemma_cli.bundled import bundled_source, mark_deleted

    store = Store(tmp_path / "models")
    name = ModelName.parse("sudoku")
    mark_deleted(store, name)
    before = files_of(store.root)
    assert bundled_source(store, name, read_only=True) is None
    assert bundled_source(store, ModelName.parse("other"), read_only=True) is None
    private = bundled_source(Store(tmp_path / "fresh"), name, read_only=True)
    assert private is not None and private.root != tmp_path / "fresh" and private.exists(name)
    assert files_of(store.root) == before and not (tmp_path / "fresh").exists()


# ---- the structured-output disk cache's bound ----------------------------------------------------------------------

def _cache_path(cache_dir: Path, vocabulary_digest: str, schema) -> Path:
    from dgemma_engine.automata import Vocabulary, cache_file

    return cache_file(cache_dir, Vocabulary({}, (), 1, vocabulary_digest), schema)


def _cache_entry(path: Path, size: int, used: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (used, used))
    return path


def test_trim_cache_removes_least_recently_used_schemas_before_any_json_object(tmp_path):
    from dgemma_engine.automata import trim_cache

    now = time.time()
    cache = tmp_path / "automata"
    any_object = _cache_entry(_cache_path(cache, "a" * 64, None), 100, now - 500)  # the oldest
    schemas = [_cache_entry(_cache_path(cache, "a" * 64, {"n": i}), 100, now - 400 + i * 100) for i in range(3)]
    other = _cache_entry(_cache_path(cache, "b" * 64, {"n": 9}), 100, now - 450)  # another vocabulary's
    dead = _cache_entry(schemas[0].with_name(".x.npz.1.2.tmp"), 100, now - 7200)  # a killed compile's scratch
    live = _cache_entry(schemas[0].with_name(".y.npz.3.4.tmp"), 100, now)  # a compile writing now
    removed = trim_cache(cache, max_bytes=250, max_files=100, keep=(schemas[2],))
    assert removed == [dead, other, schemas[0], schemas[1]]
    assert not other.parent.exists()  # the emptied vocabulary folder goes too
    assert {p for p in cache.rglob("*") if p.is_file()} == {any_object, schemas[2], live}
    assert trim_cache(cache, max_bytes=250, max_files=100) == []  # within the bound: nothing to do
    assert trim_cache(cache, max_bytes=10**9, max_files=1, keep=(schemas[2],)) == [any_object]


def test_the_disk_cache_of_a_real_compiler_stays_within_its_bound_and_reads_count_as_uses(tmp_path, gguf_path):
    """Each compile of a new schema writes a file; past the bound, the least recently used go, and a schema read
    back from disk (after a restart) counts as used."""
    import asyncio

    from dgemma_cli.server.schema_compiler import SchemaCompiler

    gguf = gguf_path("tiny-a", "f32")
    cache = tmp_path / "automata"
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
               for i in range(5)]

    def files() -> set[Path]:
        return {p for p in cache.rglob("*.npz")}

    async def compile_all(compiler, chosen) -> list[Path]:
        written = []
        for schema in chosen:
            before = files()
            await compiler.automaton(gguf, schema)
            written += sorted(files() - before)
        return written

    async def scenario():
        first = SchemaCompiler(cache, cpu_limit_s=30, disk_files=3)
        paths = await compile_all(first, schemas[:3])
        assert len(paths) == 3 and files() == set(paths)
        await first.close()
        second = SchemaCompiler(cache, cpu_limit_s=30, disk_files=3)  # a restart: nothing in memory
        await second.automaton(gguf, schemas[0])  # read from disk: now the most recently used
        (fourth,) = await compile_all(second, schemas[3:4])
        assert files() == {paths[0], paths[2], fourth}  # schema 1 was the least recently used
        sizes = sum(p.stat().st_size for p in files())
        third = SchemaCompiler(cache, cpu_limit_s=30, disk_bytes=sizes // 2)
        (fifth,) = await compile_all(third, schemas[4:5])
        assert fifth in files() and sum(p.stat().st_size for p in files()) <= max(sizes // 2, fifth.stat().st_size)
        await second.close()
        await third.close()

    asyncio.run(scenario())


def test_a_killed_read_only_servers_private_copy_is_removed_by_the_next(tmp_path, monkeypatch):
    """A read-only server keeps the bundled model in a private folder; one SIGKILLed leaves it behind, and the next
    read-only server that makes its own removes it (the folder names the process)."""
    import subprocess
    import sys
    import tempfile

    from dgemma_cli import bundled
    from dgemma_cli.store import Store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    stale = tmp_path / f"{bundled.PRIVATE_PREFIX}{dead.pid}-abc"
    (stale / "blobs").mkdir(parents=True)
    alive = tmp_path / f"{bundled.PRIVATE_PREFIX}{os.getppid()}-def"  # a running process's folder stays
    alive.mkdir()
    monkeypatch.setattr(bundled, "_private", {})
    monkeypatch.setattr(bundled, "_private_dirs", [])
    source = bundled.bundled_source(Store(tmp_path / "models"), ModelName.parse("sudoku"), read_only=True)
    assert source is not None and source.exists("sudoku")
    assert not stale.exists() and alive.exists()
    mine = [p for p in tmp_path.glob(f"{bundled.PRIVATE_PREFIX}{os.getpid()}-*")]
    assert len(mine) == 1 and str(source.root).startswith(str(mine[0]))
    for folder in bundled._private_dirs:
        folder.cleanup()
