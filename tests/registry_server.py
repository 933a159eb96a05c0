"""A real HTTP registry on 127.0.0.1 speaking Ollama's registry protocol, with Range support and injectable faults.

Reusable by any test (pull client, server pull-through):

    with FakeRegistry() as reg, FakeRegistry(blobs=reg.blobs) as cdn:     # a second loopback host serves as CDN
        manifest = reg.add_model("library/tiny:latest", [(MEDIA_MODEL, gguf_bytes)], config={...})
        reg.faults.redirect_blobs_to = cdn.url
        ... pull f"{reg.host}/library/tiny:latest" with insecure=True and DGEMMA_REGISTRY_ALLOW=reg.host,cdn.host
        reg.log    # [Request(method, path, headers, range), ...]

Each instance runs uvicorn in a daemon thread on an ephemeral port; `faults` are plain attributes a test sets
before (or during) a pull.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
TOKEN = "fake-registry-token"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Faults:
    require_token: bool = False  # answer 401 + Bearer challenge without `Authorization: Bearer <TOKEN>`
    token_realm: str | None = None  # realm URL to advertise (default: this server's /token)
    token_body: bytes | None = None  # raw /token answer (default: {"token": TOKEN})
    ignore_range: bool = False  # answer ranged requests with 200 and the whole body
    drop_after: dict[str, int] = field(default_factory=dict)  # digest -> drop the connection after N body bytes
    drop_times: int = 1  # how many responses are dropped (per digest)
    stall: dict[str, float] = field(default_factory=dict)  # digest -> seconds to stall after the first chunk
    stall_times: int = 1
    corrupt: set[str] = field(default_factory=set)  # digests served with wrong bytes (same length)
    extra_bytes: set[str] = field(default_factory=set)  # digests served with more bytes than requested
    redirect_blobs_to: str | None = None  # base URL: blob GETs redirect there (a "CDN")
    redirect_location: str | None = None  # fixed Location for blob GETs (e.g. a metadata address)
    redirect_hops: int = 0  # self-redirects before the real answer
    throttle_s: float = 0.0  # sleep between chunks
    chunk_size: int = 4096
    manifest_status: int | None = None  # answer manifests with this status and `manifest_error_body`
    manifest_error_body: bytes = b'{"errors":[{"code":"DENIED"}]}'
    manifest_headers: dict[str, str] = field(default_factory=dict)
    manifest_chunks: int = 1  # send the manifest in this many chunks (no Content-Length when > 1)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    range: tuple[int, int] | None


class FakeRegistry:
    def __init__(self, blobs: dict[str, bytes] | None = None) -> None:
        self.blobs: dict[str, bytes] = blobs if blobs is not None else {}
        self.manifests: dict[tuple[str, str, str], bytes] = {}
        self.faults = Faults()
        self.log: list[Request] = []
        self._drops: dict[str, int] = {}
        self._stalls: dict[str, int] = {}
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.proxied: list[str] = []  # absolute-form targets received while acting as an HTTP proxy
        self.routes = Starlette(routes=[
            Route("/v2/{ns}/{model}/manifests/{tag}", self._manifest, methods=["GET", "HEAD"]),
            Route("/v2/{ns}/{model}/blobs/{digest}", self._blob, methods=["GET", "HEAD"]),
            Route("/hop/{n:int}/{ns}/{model}/{digest}", self._hop, methods=["GET"]),
            Route("/token", self._token, methods=["GET"]),
        ])
        self.app = self._asgi

    async def _asgi(self, scope, receive, send):
        """Serve as a registry, and as a plain-HTTP forward proxy for itself (absolute-form request targets)."""
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(("http://", "https://")):
            self.proxied.append(path)
            rest = path.split("://", 1)[1]
            scope = {**scope, "path": "/" + rest.split("/", 1)[1] if "/" in rest else "/", "raw_path": None}
        await self.routes(scope, receive, send)

    def reset(self) -> None:
        """Forget content, faults and logs (lets a test module share one running server between tests)."""
        self.blobs.clear()
        self.manifests.clear()
        self.faults = Faults()
        self.log.clear()
        self.proxied.clear()
        self._drops.clear()
        self._stalls.clear()

    # ---- content -----------------------------------------------------------------------------------------------

    def add_blob(self, data: bytes) -> str:
        digest = digest_of(data)
        self.blobs[digest] = data
        return digest

    def add_model(self, name: str, layers: list[tuple[str, bytes]], config: dict[str, Any] | bytes | None = None) -> bytes:
        """Register `ns/model:tag` with the given (media type, bytes) layers; returns the manifest bytes."""
        path, _, tag = name.rpartition(":")
        ns, _, model = path.rpartition("/")
        if config is None:
            config = {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"]}
        config_bytes = config if isinstance(config, bytes) else json.dumps(config).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": self.add_blob(config_bytes), "size": len(config_bytes)},
            "layers": [{"mediaType": mt, "digest": self.add_blob(data), "size": len(data)} for mt, data in layers],
        }
        raw = json.dumps(manifest, indent=2).encode()  # deliberately non-canonical: pulls must store it verbatim
        self.set_manifest(ns or "library", model, tag or "latest", raw)
        return raw

    def set_manifest(self, ns: str, model: str, tag: str, raw: bytes) -> None:
        self.manifests[(ns, model, tag)] = raw

    def requests_for(self, digest: str) -> list[Request]:
        return [r for r in self.log if r.path.endswith(digest) and r.method == "GET"]

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> "FakeRegistry":
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="critical", lifespan="off", interface="asgi3",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake registry did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "FakeRegistry":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- handlers ----------------------------------------------------------------------------------------------

    def _record(self, request: StarletteRequest) -> Request:
        rng = None
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers.get("range", ""))
        if m:
            rng = (int(m[1]), int(m[2]))
        entry = Request(request.method, request.url.path, {k.lower(): v for k, v in request.headers.items()}, rng)
        self.log.append(entry)
        return entry

    def _authorized(self, request: StarletteRequest) -> Response | None:
        if not self.faults.require_token or request.headers.get("authorization") == f"Bearer {TOKEN}":
            return None
        realm = self.faults.token_realm or f"{self.url}/token"
        challenge = f'Bearer realm="{realm}",service="fake-registry",scope="repository:x:pull"'
        return JSONResponse({"errors": [{"code": "UNAUTHORIZED"}]}, status_code=401,
                            headers={"WWW-Authenticate": challenge})

    async def _token(self, request: StarletteRequest) -> Response:
        self._record(request)
        if self.faults.token_body is not None:
            return Response(self.faults.token_body, media_type="application/json")
        return JSONResponse({"token": TOKEN})

    async def _manifest(self, request: StarletteRequest) -> Response:
        self._record(request)
        denied = self._authorized(request)
        if denied is not None:
            return denied
        if self.faults.manifest_status is not None:
            return Response(self.faults.manifest_error_body, status_code=self.faults.manifest_status)
        p = request.path_params
        raw = self.manifests.get((p["ns"], p["model"], p["tag"]))
        if raw is None:
            return JSONResponse({"errors": [{"code": "MANIFEST_UNKNOWN"}]}, status_code=404)
        headers = {"Content-Type": MANIFEST_MEDIA_TYPE, **self.faults.manifest_headers}
        if self.faults.manifest_chunks > 1:
            n = self.faults.manifest_chunks
            step = max(1, len(raw) // n)

            async def chunks():
                for i in range(0, len(raw), step):
                    yield raw[i : i + step]

            return StreamingResponse(chunks(), headers=headers)
        return Response(raw, headers=headers)

    async def _hop(self, request: StarletteRequest) -> Response:
        self._record(request)
        p = request.path_params
        n = p["n"]
        target = f"/hop/{n - 1}/{p['ns']}/{p['model']}/{p['digest']}" if n > 1 else \
            f"/v2/{p['ns']}/{p['model']}/blobs/{p['digest']}?final=1"
        return Response(status_code=307, headers={"Location": target})

    async def _blob(self, request: StarletteRequest) -> Response:
        entry = self._record(request)
        denied = self._authorized(request) if "sig" not in request.query_params else None
        if denied is not None:
            return denied
        p = request.path_params
        digest = p["digest"]
        f = self.faults
        if "final" not in request.query_params and "sig" not in request.query_params:
            if f.redirect_location:
                return Response(status_code=307, headers={"Location": f.redirect_location})
            if f.redirect_hops:
                return Response(status_code=307, headers={"Location": f"/hop/{f.redirect_hops}/{p['ns']}/{p['model']}/{digest}"})
            if f.redirect_blobs_to:
                location = f"{f.redirect_blobs_to}/v2/{p['ns']}/{p['model']}/blobs/{digest}?sig=signed"
                return Response(status_code=307, headers={"Location": location})
        data = self.blobs.get(digest)
        if data is None:
            return JSONResponse({"errors": [{"code": "BLOB_UNKNOWN"}]}, status_code=404)
        if digest in f.corrupt:
            data = bytes(b ^ 0xFF for b in data)
        start, end, status = 0, len(data) - 1, 200
        if entry.range and not f.ignore_range:
            start, end, status = entry.range[0], min(entry.range[1], len(data) - 1), 206
        body = data[start : end + 1]
        headers = {"Content-Length": str(len(body)), "Content-Type": "application/octet-stream",
                   "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        if digest in f.extra_bytes:  # chunked, so the server's HTTP layer lets the surplus through
            body = body + b"EXTRA-BYTES"
            del headers["Content-Length"]
        drop_at = None
        if digest in f.drop_after and self._drops.get(digest, 0) < f.drop_times:
            self._drops[digest] = self._drops.get(digest, 0) + 1
            drop_at = f.drop_after[digest]
        stall_s = 0.0
        if digest in f.stall and self._stalls.get(digest, 0) < f.stall_times:
            self._stalls[digest] = self._stalls.get(digest, 0) + 1
            stall_s = f.stall[digest]

        async def stream():
            sent = 0
            for i in range(0, len(body), f.chunk_size):
                chunk = body[i : i + f.chunk_size]
                if drop_at is not None and sent + len(chunk) > drop_at:
                    if drop_at > sent:
                        yield chunk[: drop_at - sent]
                    await asyncio.sleep(0.05)  # let the client read what was sent before the reset
                    raise ConnectionResetError("injected connection drop")
                yield chunk
                sent += len(chunk)
                if stall_s and sent == len(chunk):
                    await asyncio.sleep(stall_s)
                if f.throttle_s:
                    await asyncio.sleep(f.throttle_s)

        return StreamingResponse(stream(), status_code=status, headers=headers)
