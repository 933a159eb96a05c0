"""docs/compat.md, security F–H against the running server: Host and Origin checks, API key, read-only mode, body and
upload caps, hostile digests, names, create payloads and GGUF uploads. Every test also checks the server stays up."""
import hashlib
import json
import socket
import struct

import httpx
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """served(env) -> (url, store): in-process servers over one store holding model `tiny`, one per distinct env."""
    root = tmp_path_factory.mktemp("security")
    store = Store(root / "models")
    add_model(store, "tiny", write_small_gguf(root / "tiny.gguf"))
    servers: dict = {}

    def start(env=None, json_cap=None):
        key = (tuple(sorted((env or {}).items())), json_cap)
        if key not in servers:
            config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1", **(env or {})})
            if json_cap is not None:
                config.max_json_body = json_cap
            servers[key] = InProcessServer(config, store, fake_factory(FakeBehaviour())).__enter__()
        return servers[key].url, store

    yield start
    for server in servers.values():
        server.__exit__(None, None, None)


HTTP = httpx.Client(timeout=30)  # one client: building one per request costs ~0.1 s (CA bundle)


def alive(url: str) -> bool:
    return HTTP.get(url + "/api/version", timeout=5).status_code == 200


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ---- F. network exposure --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:11435", "8.8.8.8", "[2001:4860::8888]:80",
                                  "localhost.evil.example", "127.0.0.1.nip.io"])
def test_rebinding_host_is_refused_with_empty_403(served, host):
    url, _ = served()
    r = HTTP.get(url + "/api/tags", headers={"Host": host})
    assert r.status_code == 403 and r.content == b""
    assert alive(url)


@pytest.mark.parametrize("host", ["localhost", "localhost:9999", "127.0.0.1", "[::1]:11435", "app.localhost",
                                  "printer.local", "svc.internal", "10.1.2.3", "192.168.0.7:80", "0.0.0.0",
                                  socket.gethostname()])
def test_local_hosts_are_accepted(served, host):
    url, _ = served()
    assert HTTP.get(url + "/api/version", headers={"Host": host}).status_code == 200


def test_allowed_hosts_env_extends_the_list(served):
    url, _ = served({"DGEMMA_ALLOWED_HOSTS": "my.proxy.example"})
    assert HTTP.get(url + "/api/version", headers={"Host": "my.proxy.example:443"}).status_code == 200
    assert HTTP.get(url + "/api/version", headers={"Host": "other.example"}).status_code == 403


def test_cors_allowlist(served):
    url, _ = served({"DGEMMA_ORIGINS": "https://*.trusted.example"})
    plain = HTTP.get(url + "/api/version")
    assert "access-control-allow-origin" not in plain.headers  # no Origin: SDKs and the CLI are unaffected
    for origin in ["http://localhost:3000", "https://127.0.0.1", "http://[::1]:8080", "app://obsidian.md",
                   "vscode-webview://abc", "https://ui.trusted.example"]:
        r = HTTP.get(url + "/api/version", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    for origin in ["https://evil.example", "http://localhost.evil.example", "null", "https://trusted.example.evil"]:
        r = HTTP.get(url + "/api/version", headers={"Origin": origin})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers and r.content == b""
        # a CORS "simple" text/plain POST is refused too, before the model runs
        r = HTTP.post(url + "/api/generate", content=b'{"model":"tiny","prompt":"x"}',
                       headers={"Origin": origin, "Content-Type": "text/plain"})
        assert r.status_code == 403
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = HTTP.options(url + "/api/chat", headers={"Origin": "http://localhost:5173", **preflight})
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in ok.headers["access-control-allow-methods"]
    bad = HTTP.options(url + "/api/chat", headers={"Origin": "https://evil.example", **preflight})
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
    assert all(r.headers.get("access-control-allow-origin") != "*" for r in (plain, ok, bad))


def test_api_key_is_required_everywhere_but_root(served):
    url, _ = served({"DGEMMA_API_KEY": "s3cret"})
    assert HTTP.get(url + "/").status_code == 200 and HTTP.head(url + "/").status_code == 200
    for method, path in [("GET", "/api/version"), ("GET", "/api/tags"), ("POST", "/api/generate"), ("GET", "/api/ps"),
                         ("HEAD", "/api/blobs/sha256:" + "0" * 64), ("DELETE", "/api/delete")]:
        r = HTTP.request(method, url + path)
        assert r.status_code == 401, path
        if method != "HEAD":
            assert r.json() == {"error": "unauthorized"}
    r = HTTP.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert HTTP.get(url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert HTTP.get(url + "/api/tags", headers={"Authorization": "s3cret"}).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert HTTP.get(url + "/api/tags", headers=good).status_code == 200
    assert HTTP.get(url + "/v1/models", headers=good).status_code == 200


def test_read_only_mode(served, tmp_path):
    url, _ = served({"DGEMMA_READONLY": "1"})
    for method, path, body in [("POST", "/api/pull", {"model": "x"}), ("POST", "/api/create", {"model": "x", "from": "tiny"}),
                               ("DELETE", "/api/delete", {"model": "tiny"}),
                               ("POST", "/api/copy", {"source": "tiny", "destination": "t2"}),
                               ("POST", "/api/blobs/" + digest(b"x"), None)]:
        r = HTTP.request(method, url + path, content=b"x" if body is None else json.dumps(body))
        assert r.status_code == 403 and r.json() == {"error": "server is read-only"}, path
    assert HTTP.post(url + "/api/push", json={"model": "tiny"}).status_code == 501
    assert HTTP.get(url + "/api/tags").json()["models"][0]["name"] == "tiny:latest"


# ---- G. resource limits ---------------------------------------------------------------------------------------------

def test_json_body_cap_is_413(served):
    url, _ = served(json_cap=4096)
    r = HTTP.post(url + "/api/generate", content=json.dumps({"model": "tiny", "prompt": "x" * 10_000}))
    assert r.status_code == 413 and r.json() == {"error": "request body too large"}
    assert alive(url)


def _blob_files(store):
    return sorted(p.name for p in store.blobs_dir.iterdir())


def test_blob_upload_caps_mismatch_and_success(served):
    url, store = served({"DGEMMA_MAX_UPLOAD": "1KB"})
    before = _blob_files(store)
    big = b"a" * 5000
    r = HTTP.post(url + "/api/blobs/" + digest(big), content=big)
    assert r.status_code == 413
    # chunked upload without Content-Length is cut off the same way, and its temp file removed
    r = HTTP.post(url + "/api/blobs/" + digest(big), content=(big[i:i + 500] for i in range(0, 5000, 500)))
    assert r.status_code == 413
    data = b"hello blob"
    r = HTTP.post(url + "/api/blobs/" + digest(b"other"), content=data)
    assert r.status_code == 400 and r.json()["error"] == (
        f'digest mismatch, expected "{digest(b"other")}", got "{digest(data)}"')
    assert _blob_files(store) == before  # nothing left behind
    r = HTTP.post(url + "/api/blobs/" + digest(data).upper().replace("SHA256", "sha256"), content=data)
    assert r.status_code == 201
    assert HTTP.post(url + "/api/blobs/" + digest(data), content=data).status_code == 200  # exists: not re-read
    assert HTTP.head(url + "/api/blobs/" + digest(data)).status_code == 200
    missing = HTTP.head(url + "/api/blobs/" + digest(b"missing"))
    assert missing.status_code == 404
    assert alive(url)


@pytest.mark.parametrize("bad", ["sha256:../../etc/passwd", "sha256:" + "a" * 63, "sha256:" + "a" * 65,
                                 "sha256-" + "a" * 64 + "%2F..%2Fx", "md5:" + "a" * 32, "..%2F..%2Fx",
                                 "sha256:" + "a" * 63 + "%00", "sha256:" + "g" * 64])
def test_traversal_digests_are_400_and_touch_nothing(served, bad):
    url, store = served()
    before = _blob_files(store)
    for method in ("HEAD", "POST"):
        r = HTTP.request(method, url + "/api/blobs/" + bad, content=b"x" if method == "POST" else None)
        assert r.status_code in (400, 404), (bad, r.status_code)  # 404 only when the path never reaches the route
        if method == "POST" and r.status_code == 400:
            assert r.json()["error"] == "invalid digest format"
    r = HTTP.post(url + "/api/create", json={"model": "evil", "files": {"model.gguf": bad.replace("%2F", "/")}})
    assert r.status_code == 400
    assert _blob_files(store) == before and alive(url)


def test_invalid_names_on_every_endpoint(served):
    url, store = served()
    for name in ["../../etc/passwd", "a/b/c/d", "model:tag/x", ".hidden", "-dash", "a\\b", "x" * 81]:
        for method, path, body in [("POST", "/api/show", {"model": name}), ("POST", "/api/generate", {"model": name}),
                                   ("POST", "/api/chat", {"model": name, "messages": []}),
                                   ("DELETE", "/api/delete", {"model": name}), ("POST", "/api/pull", {"model": name}),
                                   ("POST", "/api/create", {"model": name, "from": "tiny"})]:
            r = HTTP.request(method, url + path, content=json.dumps(body))
            assert r.status_code == 400 and r.json() == {"error": "invalid model name"}, (name, path)
        r = HTTP.post(url + "/api/copy", json={"source": "tiny", "destination": name})
        assert r.json() == {"error": f'destination "{name}" is invalid'}
    assert HTTP.post(url + "/api/copy", json={"source": "nope", "destination": "b"}).json() == {
        "error": "model 'nope' not found"}


def test_create_refuses_server_side_paths(served, tmp_path):
    url, store = served()
    before = _blob_files(store)
    data = write_small_gguf(tmp_path / "x.gguf").read_bytes()
    for body in [{"model": "m", "path": "/etc/passwd"}, {"model": "m", "modelfile": "FROM /etc/passwd"},
                 {"model": "m", "files": {"/abs/model.gguf": digest(data)}},
                 {"model": "m", "files": {"../model.gguf": digest(data)}},
                 {"model": "m", "files": {"C:\\model.gguf": digest(data)}},
                 {"model": "m", "from": "/etc/passwd", "stream": False},
                 {"model": "m", "from": "../../outside.gguf", "stream": False},
                 {"model": "m"}]:
        r = HTTP.post(url + "/api/create", json=body)
        assert r.status_code == 400, body
        assert str(tmp_path) not in r.text
    assert _blob_files(store) == before


def _hostile_ggufs() -> dict[str, bytes]:
    def gstr(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    head = b"GGUF" + struct.pack("<I", 3)
    arch = gstr(b"general.architecture") + struct.pack("<I", 8) + gstr(b"diffusion-gemma")
    return {
        "empty": b"",
        "magic-only": b"GGUF",
        "bad-version": b"GGUF" + struct.pack("<IQQ", 99, 0, 0),
        "huge-counts": head + struct.pack("<QQ", 2**63, 2**63),
        "string-past-eof": head + struct.pack("<QQ", 0, 1) + struct.pack("<Q", 2**40) + b"key",
        "truncated-kv": head + struct.pack("<QQ", 0, 2) + arch,
        "not-gguf": b"\x7fELF" + b"\0" * 60,
    }


def test_malformed_gguf_uploads_are_400_at_create_and_server_stays_up(served):
    url, store = served()
    for label, data in _hostile_ggufs().items():
        r = HTTP.post(url + "/api/blobs/" + digest(data), content=data)
        assert r.status_code in (200, 201), label  # blobs are opaque until used
        r = HTTP.post(url + "/api/create", json={"model": "bad", "files": {"model.gguf": digest(data)}, "stream": False})
        error = r.json()["error"]
        assert r.status_code == 400 and error.startswith("supplied file was not in GGUF format (invalid GGUF: "), \
            (label, r.text)
        assert "\n" not in error and len(error) < 300
        r = HTTP.post(url + "/api/create", json={"model": "bad", "files": {"model.gguf": digest(data)}})
        assert r.status_code == 400, label  # streaming too: the check runs before the first byte
        assert alive(url)
    assert not store.exists("bad")


def test_other_architecture_is_refused(served, tmp_path):
    url, store = served()
    data = write_small_gguf(tmp_path / "llama.gguf", arch="llama").read_bytes()
    HTTP.post(url + "/api/blobs/" + digest(data), content=data)
    r = HTTP.post(url + "/api/create", json={"model": "llama", "files": {"m.gguf": digest(data)}, "stream": False})
    assert r.status_code == 400 and r.json() == {"error": 'model architecture "llama" is not supported by dgemma'}
    add_model(store, "llama", tmp_path / "llama.gguf", family="llama")
    r = HTTP.post(url + "/api/generate", json={"model": "llama", "prompt": "x"})
    assert r.status_code == 400 and r.json() == {"error": 'model architecture "llama" is not supported by dgemma'}


# ---- H. templates ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload", ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                     "{{ cycler.__init__.__globals__ }}",
                                     "{% for i in range(10**9) %}x{% endfor %}"])
def test_template_payloads_fail_safely_at_create(served, payload):
    """Jinja payloads are refused at create; text without Jinja statements is stored as a Go template, which is
    only ever rendered by the safe Go-subset renderer (docs/compat.md#template-policy), never by Jinja."""
    url, store = served()
    name = "evil" + hashlib.sha256(payload.encode()).hexdigest()[:8]
    r = HTTP.post(url + "/api/create", json={"model": name, "from": "tiny", "template": payload, "stream": False})
    if r.status_code == 400:
        assert r.json()["error"].startswith("template error") and not store.exists(name)
    else:
        assert r.status_code == 200 and store.resolve(name).config.get("template_format") == "go"
    assert alive(url)


def test_template_text_in_messages_is_plain_data(served):
    url, _ = served()
    payload = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    r = HTTP.post(url + "/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": payload}],
                                            "stream": False})
    assert r.status_code == 200 and r.json()["done"] is True


def test_errors_never_leak_the_store_path(served, tmp_path):
    url, store = served()
    bodies = []
    for method, path, body in [("POST", "/api/show", {"model": "missing"}),
                               ("POST", "/api/create", {"model": "m", "files": {"a.gguf": digest(b"nothing")}}),
                               ("POST", "/api/generate", {"model": "tiny", "prompt": "x", "options": {"num_ctx": 2}}),
                               ("POST", "/api/pull", {"model": "127.0.0.1:1/library/x", "stream": False}),
                               ("DELETE", "/api/delete", {"model": "missing"})]:
        r = HTTP.request(method, url + path, content=json.dumps(body), timeout=30)
        assert r.status_code >= 400
        bodies.append(r.text)
    assert all(str(tmp_path) not in b and str(store.root) not in b for b in bodies)
