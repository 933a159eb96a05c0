"""`pull` against a real HTTP registry on 127.0.0.1 (tests/registry_server.py) with injected faults."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dgemma_cli.errors import DgemmaError
from dgemma_cli.registry import PullOptions, pull
from dgemma_cli.store import (MEDIA_LICENSE, MEDIA_MESSAGES, MEDIA_MODEL, MEDIA_PARAMS, MEDIA_SYSTEM, MEDIA_TEMPLATE,
                              Store)
from registry_server import digest_of
from store_helpers import tiny_gguf_bytes

PART = 256  # tiny parts so every blob is multi-part


def fast_options(**kw) -> PullOptions:
    base = dict(part_size=PART, streams=4, stall_timeout=2.0, retries=3, backoff=0.01, connect_timeout=5.0,
                free_disk_margin=0, progress_interval=0.005)
    base.update(kw)
    return PullOptions(**base)


@pytest.fixture
def gguf_blob(tmp_path: Path) -> bytes:
    return tiny_gguf_bytes(tmp_path)



def run_pull(name: str, store: Store, **kw) -> list[dict]:
    options = kw.pop("options", None) or fast_options()
    return list(pull(name, store, insecure=kw.pop("insecure", True), options=options, **kw))


def store_files(store: Store) -> set[str]:
    return {str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file()} if store.root.exists() else set()


def test_happy_path_three_layers_multipart(registry, gguf_blob, tmp_path):
    license_text = b"Apache-2.0 " * 100
    params = json.dumps({"diffusion_steps": 32}).encode()
    raw = registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_PARAMS, params),
                                                     (MEDIA_LICENSE, license_text)])
    store = Store(tmp_path / "store")
    events = run_pull(f"{registry.host}/library/tiny:latest", store)

    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    model_digest = digest_of(gguf_blob)
    per_layer = [e for e in events if e.get("digest") == model_digest]
    completed = [e.get("completed", 0) for e in per_layer]
    assert completed == sorted(completed) and completed[-1] == len(gguf_blob)
    assert all(e["total"] == len(gguf_blob) and e["status"] == f"pulling {model_digest[7:19]}" for e in per_layer)
    # Stored byte-for-byte as received, under Ollama's layout.
    manifest_path = store.root / "manifests" / registry.host / "library" / "tiny" / "latest"
    assert manifest_path.read_bytes() == raw
    for data in (gguf_blob, params, license_text):
        assert (store.root / "blobs" / f"sha256-{digest_of(data)[7:]}").read_bytes() == data
    assert not [p for p in store.blobs_dir.iterdir() if "partial" in p.name]
    # The model blob really came in several ranged parts.
    ranges = [r.range for r in registry.requests_for(model_digest)]
    assert len(ranges) == -(-len(gguf_blob) // PART) and all(r is not None for r in ranges)


def test_existing_blobs_report_complete_without_get(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store)
    registry.log.clear()
    events = run_pull(f"{registry.host}/library/tiny:latest", store)
    layer_events = [e for e in events if e.get("digest") == digest_of(gguf_blob)]
    assert layer_events == [{"status": f"pulling {digest_of(gguf_blob)[7:19]}", "digest": digest_of(gguf_blob),
                             "total": len(gguf_blob), "completed": len(gguf_blob)}]
    assert not registry.requests_for(digest_of(gguf_blob))


def test_dropped_connection_resumes_without_refetching_finished_parts(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    digest = digest_of(gguf_blob)
    registry.faults.chunk_size = 64
    registry.faults.drop_after = {digest: 100}  # the first response for this blob dies after 100 bytes
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store, options=fast_options(streams=1))
    assert store.blob_path(digest).read_bytes() == gguf_blob
    ranges = [r.range for r in registry.requests_for(digest)]
    n_parts = -(-len(gguf_blob) // PART)
    assert len(ranges) == n_parts + 1  # one retry, no other re-download
    assert ranges[0] == (0, PART - 1)
    assert ranges[1][0] > 0 and ranges[1][1] == PART - 1  # the retry asked only for the missing tail of part 0
    assert sorted(ranges[1:]) == sorted(set(ranges[1:]))


def test_interrupted_pull_resumes_from_sidecars_in_a_new_pull(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    digest = digest_of(gguf_blob)
    n_parts = -(-len(gguf_blob) // PART)
    registry.faults.drop_after = {digest: 0}
    registry.faults.drop_times = 1
    store = Store(tmp_path / "store")
    # streams=1, no retries: parts before the failing one... make the 3rd request fail instead.
    registry.faults.drop_after = {}
    cancel = threading.Event()
    seen = []
    gen = pull(f"{registry.host}/library/tiny:latest", store, insecure=True, cancel=cancel,
               options=fast_options(streams=1))
    registry.faults.throttle_s = 0.02
    registry.faults.chunk_size = 64
    with pytest.raises(DgemmaError, match="pull cancelled"):
        for event in gen:
            seen.append(event)
            if event.get("digest") == digest and event.get("completed", 0) >= len(gguf_blob) // 2:
                cancel.set()
    first_ranges = [r.range for r in registry.requests_for(digest)]
    assert 1 < len(first_ranges) < n_parts + 1
    sidecars = sorted(store.blobs_dir.glob(f"sha256-{digest[7:]}-partial-*"))
    assert sidecars and store.partial_path(digest).exists()
    state0 = json.loads(sidecars[0].read_text())
    assert state0 == {"N": 0, "Offset": 0, "Size": PART, "Completed": PART}

    registry.faults.throttle_s = 0
    registry.log.clear()
    run_pull(f"{registry.host}/library/tiny:latest", store, options=fast_options(streams=1))
    assert store.blob_path(digest).read_bytes() == gguf_blob
    second = [r.range for r in registry.requests_for(digest)]
    assert second and all(start >= PART for start, _ in second)  # finished part 0 was not requested again
    assert len(second) <= n_parts - 1


def test_corrupted_sidecar_redoes_that_part(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    digest = digest_of(gguf_blob)
    store = Store(tmp_path / "store")
    store.ensure_dirs()
    # A previous run left a full-size partial and sidecars; one lies about its offset, one is garbage.
    store.partial_path(digest).write_bytes(gguf_blob[:PART] + b"\0" * (len(gguf_blob) - PART))
    store.sidecar_path(digest, 0).write_text(json.dumps({"N": 0, "Offset": 0, "Size": PART, "Completed": PART}))
    store.sidecar_path(digest, 1).write_text(json.dumps({"N": 1, "Offset": -5, "Size": 10**9, "Completed": 10**9}))
    store.sidecar_path(digest, 2).write_text("{not json")
    run_pull(f"{registry.host}/library/tiny:latest", store)
    assert store.blob_path(digest).read_bytes() == gguf_blob
    starts = sorted(r.range[0] for r in registry.requests_for(digest))
    assert 0 not in starts and PART in starts and 2 * PART in starts


def test_digest_mismatch_removes_partial_and_registers_nothing(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    digest = digest_of(gguf_blob)
    registry.faults.corrupt = {digest}
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError) as exc:
        run_pull(f"{registry.host}/library/tiny:latest", store)
    assert str(exc.value).startswith(f"digest mismatch, file must be downloaded again: want {digest}, got sha256:")
    assert not store.has_blob(digest)
    assert not [p for p in store.blobs_dir.iterdir() if "partial" in p.name]
    assert not store.list_models() and not (store.root / "manifests" / registry.host).exists()


def test_unknown_model_clear_error(registry, tmp_path):
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match="^pull model manifest: file does not exist$") as exc:
        run_pull(f"{registry.host}/library/nope:latest", store)
    assert exc.value.status == 404


def test_registry_error_body_is_capped(registry, tmp_path):
    registry.faults.manifest_status = 500
    registry.faults.manifest_error_body = b"x" * 100_000
    with pytest.raises(DgemmaError) as exc:
        run_pull(f"{registry.host}/library/tiny:latest", Store(tmp_path / "s"))
    assert str(exc.value).startswith("pull model manifest: 500: xxx") and len(str(exc.value)) < 600


def test_hf_name_resolves_through_mirror(registry, gguf_blob, tmp_path, monkeypatch):
    registry.add_model("unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M", [(MEDIA_MODEL, gguf_blob)])
    monkeypatch.setenv("DGEMMA_REGISTRY_MIRRORS", f"hf.co={registry.url}")
    monkeypatch.setenv("DGEMMA_REGISTRY_ALLOW", "")  # a mirror target is implicitly allowed
    store = Store(tmp_path / "store")
    events = run_pull("hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M", store, insecure=False)
    assert events[-1] == {"status": "success"}
    assert [m.name for m in store.list_models()] == ["hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M"]
    assert (store.root / "manifests/hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF/Q4_K_M").is_file()
    assert registry.log[0].path == "/v2/unsloth/diffusiongemma-26B-A4B-it-GGUF/manifests/Q4_K_M"
    assert registry.log[0].headers["host"] == registry.host


def test_token_challenge_then_cdn_redirect_without_authorization(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    registry.faults.require_token = True
    registry.faults.redirect_blobs_to = registry.cdn.url
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store)
    assert store.blob_path(digest_of(gguf_blob)).read_bytes() == gguf_blob
    assert any(r.path == "/token" for r in registry.log)
    authed = [r for r in registry.log if r.path.startswith("/v2/") and "authorization" in r.headers]
    assert authed and all(r.headers["authorization"] == "Bearer fake-registry-token" for r in authed)
    cdn_requests = [r for r in registry.cdn.log if r.method == "GET"]
    assert cdn_requests and all("authorization" not in r.headers for r in cdn_requests)


def test_range_ignored_falls_back_to_one_stream(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    registry.faults.ignore_range = True
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store)
    assert store.blob_path(digest_of(gguf_blob)).read_bytes() == gguf_blob
    assert registry.requests_for(digest_of(gguf_blob))[-1].range is None


def test_stalled_part_is_restarted(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    digest = digest_of(gguf_blob)
    registry.faults.chunk_size = 64
    registry.faults.stall = {digest: 3.0}
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store, options=fast_options(stall_timeout=0.5, streams=1))
    assert store.blob_path(digest).read_bytes() == gguf_blob
    assert len(registry.requests_for(digest)) == -(-len(gguf_blob) // PART) + 1


def test_more_bytes_than_requested_aborts_the_part(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    registry.faults.extra_bytes = {digest_of(gguf_blob)}
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match="more bytes than requested"):
        run_pull(f"{registry.host}/library/tiny:latest", store, options=fast_options(retries=1))
    assert not store.has_blob(digest_of(gguf_blob)) and not store.list_models()


def test_concurrent_pulls_share_one_download(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    registry.faults.throttle_s = 0.01
    registry.faults.chunk_size = 128
    store = Store(tmp_path / "store")
    results: list[list[dict]] = []

    def one() -> None:
        results.append(run_pull(f"{registry.host}/library/tiny:latest", store))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and all(r[-1] == {"status": "success"} for r in results)
    ranges = [r.range for r in registry.requests_for(digest_of(gguf_blob))]
    assert len(ranges) == len(set(ranges)) == -(-len(gguf_blob) // PART)


def test_non_diffusion_family_stops_before_weights(registry, gguf_blob, tmp_path):
    registry.add_model("library/llama:latest", [(MEDIA_MODEL, gguf_blob)], config={"model_family": "llama"})
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match='^model architecture "llama" is not supported by dgemma$'):
        run_pull(f"{registry.host}/library/llama:latest", store)
    assert not registry.requests_for(digest_of(gguf_blob))


def test_non_gguf_model_layer_is_refused_and_not_registered(registry, tmp_path):
    blob = b"this is not a gguf file" * 10
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, blob)])
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match="invalid GGUF"):
        run_pull(f"{registry.host}/library/tiny:latest", store)
    assert not store.has_blob(digest_of(blob)) and not store.list_models()


def test_repull_with_new_manifest_removes_unused_layers(registry, gguf_blob, tmp_path):
    old_params = b'{"diffusion_steps": 16}'
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_PARAMS, old_params)])
    store = Store(tmp_path / "store")
    run_pull(f"{registry.host}/library/tiny:latest", store)
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_PARAMS, b'{"diffusion_steps": 8}')])
    events = run_pull(f"{registry.host}/library/tiny:latest", store)
    assert {"status": "removing unused layers"} in events
    assert not store.has_blob(digest_of(old_params)) and store.has_blob(digest_of(gguf_blob))


def test_free_disk_check_before_download(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError, match="insufficient disk space"):
        run_pull(f"{registry.host}/library/tiny:latest", store, options=fast_options(free_disk_margin=1 << 60))
    assert not registry.requests_for(digest_of(gguf_blob))


def test_http_proxy_from_environment_is_used(registry, gguf_blob, tmp_path, monkeypatch):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    monkeypatch.setenv("HTTP_PROXY", registry.url)  # the fake registry also answers as a forward proxy
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    store = Store(tmp_path / "store")
    assert run_pull(f"{registry.host}/library/tiny:latest", store)[-1] == {"status": "success"}
    assert registry.proxied and all(t.startswith(f"http://{registry.host}/v2/") for t in registry.proxied)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    registry.proxied.clear()
    run_pull(f"{registry.host}/library/tiny:latest", Store(tmp_path / "store2"))
    assert not registry.proxied


def test_connects_to_the_vetted_address_without_a_second_lookup(registry, gguf_blob, tmp_path, monkeypatch):
    import socket

    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    real = socket.getaddrinfo
    lookups = []

    def fake_getaddrinfo(host, port, *args, **kwargs):
        if host == "registry.test":
            lookups.append(host)
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    monkeypatch.setenv("DGEMMA_REGISTRY_ALLOW", f"registry.test:{registry.port}")
    name = f"http://registry.test:{registry.port}/library/tiny:latest"
    assert run_pull(name, Store(tmp_path / "store"))[-1] == {"status": "success"}
    requests = [r for r in registry.log if r.path.startswith("/v2/")]
    assert requests and all(r.headers["host"] == f"registry.test:{registry.port}" for r in requests)
    assert len(lookups) == len(requests)  # one vetting lookup per request, none by the HTTP stack


def test_one_puller_leaving_does_not_cancel_a_shared_download(registry, gguf_blob, tmp_path):
    registry.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_blob)])
    registry.faults.throttle_s = 0.02
    registry.faults.chunk_size = 64
    digest = digest_of(gguf_blob)
    store = Store(tmp_path / "store")
    name = f"{registry.host}/library/tiny:latest"
    first = pull(name, store, insecure=True, options=fast_options(streams=1))
    for event in first:  # the first puller starts the transfer, then leaves mid-way
        if event.get("digest") == digest and event.get("completed"):
            break
    second_events = []
    second = threading.Thread(target=lambda: second_events.extend(run_pull(name, store, options=fast_options(streams=1))))
    second.start()
    import time as _time

    from dgemma_cli import registry as registry_module

    deadline = _time.monotonic() + 10
    while _time.monotonic() < deadline:  # wait until the second puller has joined the running transfer
        with registry_module._transfers_lock:
            if any(t.waiters == 2 for t in registry_module._transfers.values()):
                break
        _time.sleep(0.005)
    first.close()  # GeneratorExit: this client has gone, the other still waits
    second.join(30)
    assert second_events and second_events[-1] == {"status": "success"}
    assert store.blob_path(digest).read_bytes() == gguf_blob
    ranges = [r.range for r in registry.requests_for(digest)]
    assert len(ranges) == len(set(ranges))  # nothing was downloaded twice


# ---- pulled layers are checked as strictly as the Modelfile lines they stand for (issue 36, item 9) ---------------

HOSTILE_LAYERS = {
    "messages": (MEDIA_MESSAGES, json.dumps([1, "x", {"role": "wizard"}]).encode(),
                 'invalid messages layer: messages[0]: a message is an object with "role" and "content"'),
    "wizard": (MEDIA_MESSAGES, json.dumps([{"role": "wizard", "content": "x"}]).encode(),
               'invalid messages layer: messages[0]: message role must be one of "system", "user", or "assistant"'),
    "messages not JSON": (MEDIA_MESSAGES, b"[{", "invalid messages layer: not valid JSON"),
    "threads": (MEDIA_PARAMS, json.dumps({"num_thread": 1000}).encode(),
                "invalid params layer: invalid value for num_thread: 1000 (must be between 0 and "),
    "params type": (MEDIA_PARAMS, json.dumps({"num_ctx": "big"}).encode(),
                    'invalid params layer: option "num_ctx" must be of type integer'),
    "params list": (MEDIA_PARAMS, b"[1]", "invalid params layer: parameters must be an object"),
    "unknown param": (MEDIA_PARAMS, b'{"tfs_z": 1}', "invalid params layer: unknown parameter 'tfs_z'"),
    "sampler range": (MEDIA_PARAMS, b'{"diffusion_steps": 0}',
                      "invalid params layer: invalid value for diffusion_steps: 0 (must be between 1 and "),
    "template quotes": (MEDIA_TEMPLATE, b'say """ twice', "invalid template layer: value may not contain '\"\"\"'"),
    "jinja template": (MEDIA_TEMPLATE, b"{% for m in messages %}{{ m.content }",
                       "invalid template layer: template error: "),
    "system quotes": (MEDIA_SYSTEM, b'"""', "invalid system layer: value may not contain '\"\"\"'"),
    "license quotes": (MEDIA_LICENSE, b'a """ b', "invalid license layer: value may not contain '\"\"\"'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LAYERS))
def test_a_hostile_settings_layer_is_a_400_before_the_weights(registry, gguf_blob, tmp_path, case):
    media_type, data, message = HOSTILE_LAYERS[case]
    registry.add_model("library/bad:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_LICENSE, b"MIT"), (media_type, data)])
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError) as exc:
        run_pull(f"{registry.host}/library/bad:latest", store)
    assert exc.value.status == 400 and str(exc.value).startswith(message), str(exc.value)
    assert not registry.requests_for(digest_of(gguf_blob))  # refused before any weights were fetched
    assert not store.list_models() and not list(store.blobs_dir.iterdir())  # and nothing left behind


def test_a_config_requires_that_is_not_semver_is_refused(registry, gguf_blob, tmp_path):
    config = {"model_format": "gguf", "model_family": "diffusion-gemma", "requires": "x" * 10_000}
    registry.add_model("library/bad:latest", [(MEDIA_MODEL, gguf_blob)], config=config)
    store = Store(tmp_path / "store")
    with pytest.raises(DgemmaError) as exc:
        run_pull(f"{registry.host}/library/bad:latest", store)
    assert (exc.value.status, str(exc.value)) == (400, "invalid config layer: requires must be a valid semver "
                                                       "(e.g. 0.14.0)")
    assert not registry.requests_for(digest_of(gguf_blob)) and not list(store.blobs_dir.iterdir())


def test_refused_manifests_are_400_with_their_reason(registry, gguf_blob, tmp_path):
    store = Store(tmp_path / "store")
    registry.add_model("library/split:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_MODEL, gguf_blob + b"x")])
    raw = json.loads(registry.add_model("library/rep:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_PARAMS, b"{}")]))
    raw["layers"].append(dict(raw["layers"][1]))
    registry.set_manifest("library", "rep", "latest", json.dumps(raw).encode())
    registry.add_model("library/llama:latest", [(MEDIA_MODEL, gguf_blob)], config={"model_family": "llama"})
    for model, message in (("split", "split GGUF models (more than one model layer) are not supported"),
                           ("rep", "invalid manifest: repeated layer digest"),
                           ("llama", 'model architecture "llama" is not supported by dgemma')):
        with pytest.raises(DgemmaError) as exc:
            run_pull(f"{registry.host}/library/{model}:latest", store)
        assert (exc.value.status, str(exc.value)) == (400, message)
    assert not store.list_models() and not list(store.blobs_dir.iterdir())  # the refused config blob went too


def test_valid_settings_layers_are_stored_as_received(registry, gguf_blob, tmp_path):
    params = b'{"num_thread": 2, "stop": ["<end>"], "temperature": 0.5, "mirostat": 1}'
    messages = b'[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]'
    registry.add_model("library/ok:latest", [(MEDIA_MODEL, gguf_blob), (MEDIA_TEMPLATE, b"{{ .Prompt }}"),
                                             (MEDIA_PARAMS, params), (MEDIA_MESSAGES, messages)])
    store = Store(tmp_path / "store")
    assert run_pull(f"{registry.host}/library/ok:latest", store)[-1] == {"status": "success"}
    local = store.resolve(f"{registry.host}/library/ok:latest")
    assert local.parameters["num_thread"] == 2 and local.messages[1] == {"role": "assistant", "content": "Hello"}
    assert store.blob_path(digest_of(params)).read_bytes() == params  # verbatim: the digest is the registry's
