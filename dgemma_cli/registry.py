"""`pull`: a client for Ollama-protocol registries (registry.ollama.ai, hf.co, mirrors), docs/compat.md#pull-protocol,
security E.

Flow: name -> base URL (mirror override, https unless insecure+loopback) -> SSRF gate -> manifest (4 MiB cap, bearer
token challenge) -> config blob (family check before any weights) -> the settings layers (template, system, license,
params, messages), checked by the functions that check those Modelfile lines at create -> each other layer in ranged
parts, in parallel, into a sparse `-partial` file with per-part JSON sidecars (resumable) -> sha256 verification ->
GGUF check -> atomic manifest write -> removal of layers the old manifest alone used. Progress objects are yielded as
Ollama streams them. A model dgemma refuses (family, split GGUF, a bad layer) is a 400 (`PullRefused`), a registry
that misbehaves a 502 (`RegistryError`).

Every request goes to an address vetted by the SSRF gate (connecting to the vetted IP, so a second DNS answer cannot
rebind it); redirects are followed by hand, each hop vetted, and `Authorization` is never sent to another host.
"""
from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import math
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlencode, urljoin, urlsplit

import httpx
from dgemma_engine.arch import check_architecture

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError
from dgemma_cli.gguf_check import check_model_gguf
from dgemma_cli.hosts import is_loopback_host
from dgemma_cli.modelfile import check_messages, check_parameters, check_requires, check_template, quote
from dgemma_cli.names import ModelName
from dgemma_cli.projector import check_projector
from dgemma_cli.store import (
    MANIFEST_MEDIA_TYPE,
    MAX_MANIFEST_BYTES,
    MAX_TEXT_LAYER_BYTES,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Layer,
    Manifest,
    Store,
    parse_manifest,
    sha256_file,
)

MAX_TOKEN_BYTES = 64 << 10
MAX_ERROR_BYTES = 512
MAX_CONFIG_BYTES = 1 << 20
MAX_REDIRECTS = 10
MIN_PART, MAX_PART = 100_000_000, 1_000_000_000


class PullError(DgemmaError):
    status = 500


class ManifestNotFoundError(PullError):
    status = 404


class RegistryError(PullError):
    """The registry (or a redirect target) misbehaved or refused."""

    status = 502


class BlockedHostError(PullError):
    status = 400


class PullRefused(PullError):
    """The registry answered, but with a model dgemma refuses (its manifest, family or layers): nothing is stored."""

    status = 400


class PullCancelled(PullError):
    status = 499

    def __init__(self) -> None:
        super().__init__("pull cancelled")


class _RangeNotSupported(Exception):
    pass


class _Retryable(Exception):
    pass


@dataclass
class PullOptions:
    part_size: int | None = None  # None: total/16 clamped to [100 MB, 1000 MB]
    streams: int = 8
    stall_timeout: float = 30.0
    retries: int = 6
    backoff: float = 1.0
    connect_timeout: float = 30.0
    free_disk_margin: int = 1 << 30
    progress_interval: float = 0.06

    @classmethod
    def from_env(cls) -> "PullOptions":
        """Defaults, overridable for tests and slow links (DGEMMA_PULL_* variables)."""
        return cls(
            part_size=env.PULL_PART_SIZE.get_or_default() or None,
            streams=max(1, env.PULL_STREAMS.get_or_default()),
            stall_timeout=env.PULL_STALL_TIMEOUT.get_or_default() or 30.0,
            retries=env.PULL_RETRIES.get_or_default(),
            backoff=env.PULL_BACKOFF.get_or_default(),
        )

    def part_size_for(self, total: int) -> int:
        if self.part_size:
            return self.part_size
        return min(max(total // 16, MIN_PART), MAX_PART)


# ---- addresses: mirrors, allow list, SSRF gate ---------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    prefix: str = ""  # path prefix of a mirror base URL

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}{path}"


def _split_host_port(hostport: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit("//" + hostport)
    try:
        port = parts.port
    except ValueError:
        raise BlockedHostError(f"invalid registry address {hostport!r}") from None
    return (parts.hostname or ""), (port or default_port)


def registry_mirrors() -> dict[str, str]:
    """`DGEMMA_REGISTRY_MIRRORS="hf.co=http://127.0.0.1:8080,registry.ollama.ai=..."` as {host: base URL}."""
    mirrors = {}
    for item in env.REGISTRY_MIRRORS.get().split(","):
        host, sep, url = item.strip().partition("=")
        if sep and host.strip() and url.strip():
            mirrors[host.strip().lower()] = url.strip().rstrip("/")
    return mirrors


def registry_allow_list() -> set[str]:
    return {item.strip().lower() for item in env.REGISTRY_ALLOW.get().split(",") if item.strip()}


def registry_endpoint(name: ModelName, insecure: bool = False) -> tuple[Endpoint, bool]:
    """Where requests for `name` go, and whether that endpoint is implicitly allowed (a configured mirror).

    Scheme is https unless `insecure` and the name says `http://` explicitly or the host is loopback; `insecure`
    never downgrades any other registry (Open WebUI always sends `insecure: true`)."""
    mirror = registry_mirrors().get(name.host.lower())
    if mirror is not None:
        parts = urlsplit(mirror)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PullError(f"invalid mirror URL for {name.host}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return Endpoint(parts.scheme, parts.hostname, port, parts.path.rstrip("/")), True
    host, _ = _split_host_port(name.host, 0)
    plain = insecure and (name.scheme == "http" or is_loopback_host(host))
    scheme = "http" if plain else "https"
    host, port = _split_host_port(name.host, 80 if plain else 443)
    return Endpoint(scheme, host, port), False


def _blocked_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved


def vet_address(host: str, port: int, implicitly_allowed: bool = False) -> str:
    """Resolve `host` once and return the IP to connect to; refuse internal addresses unless allowed
    (docs/compat.md, security E13)."""
    allow = registry_allow_list()
    allowed = implicitly_allowed or host.lower() in allow or f"{host.lower()}:{port}" in allow
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        raise RegistryError(f"cannot resolve registry host {host!r}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise RegistryError(f"cannot resolve registry host {host!r}")
    if not allowed and any(_blocked_ip(ip) for ip in addresses):
        raise BlockedHostError(
            f"registry host {host!r} resolves to a private or local address (set DGEMMA_REGISTRY_ALLOW to permit it)"
        )
    return str(addresses[0])


# First-party token services that live on a sibling domain of their registry (and only those): a realm elsewhere
# is refused (CVE-2025-51471 class).
_AUTH_SIBLINGS = {"hf.co": {"huggingface.co"}, "huggingface.co": {"hf.co"}, "registry.ollama.ai": {"ollama.com"}}


def _same_auth_host(realm_host: str, registry_host: str) -> bool:
    realm_host, registry_host = realm_host.lower(), registry_host.lower()
    return realm_host == registry_host or realm_host in _AUTH_SIBLINGS.get(registry_host, set())


# ---- HTTP --------------------------------------------------------------------------------------------------------

def _read_capped(resp: httpx.Response, cap: int, what: str) -> bytes:
    """Read a body of at most `cap` bytes, refusing compressed encodings (decompression bombs)."""
    encoding = resp.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise RegistryError(f"{what}: unexpected content encoding {encoding!r}")
    data = bytearray()
    for chunk in resp.iter_raw():
        data += chunk
        if len(data) > cap:
            raise RegistryError(f"{what} is too large (more than {cap} bytes)")
    return bytes(data)


def _error_snippet(resp: httpx.Response) -> str:
    data = b""
    try:
        for chunk in resp.iter_raw():
            data += chunk
            if len(data) >= MAX_ERROR_BYTES:
                break
    except httpx.HTTPError:
        pass
    return data[:MAX_ERROR_BYTES].decode("utf-8", errors="replace").strip()


def _parse_challenge(header: str) -> dict[str, str]:
    scheme, _, params = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return {}
    return {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', params)}


class RegistryClient:
    """HTTP to one registry: vetted addresses, manual redirects, bearer tokens for the registry host only."""

    def __init__(self, name: ModelName, insecure: bool, options: PullOptions) -> None:
        self.name = name
        self.insecure = insecure
        self.endpoint, self.mirrored = registry_endpoint(name, insecure)
        self.options = options
        self.token: str | None = None
        self._token_lock = threading.Lock()
        timeout = httpx.Timeout(options.connect_timeout, read=options.stall_timeout)
        limits = httpx.Limits(max_connections=max(8, options.streams * 2), max_keepalive_connections=options.streams)
        self.http = httpx.Client(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)
        self._proxied: dict[str, httpx.Client] = {}
        self._client_args = dict(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)

    def close(self) -> None:
        self.http.close()
        for client in self._proxied.values():
            client.close()

    def _proxy_client(self, url: httpx.URL) -> httpx.Client | None:
        """A client through HTTPS_PROXY/HTTP_PROXY when one applies to `url` (NO_PROXY honoured), else None."""
        proxies = urllib.request.getproxies_environment()
        proxy = proxies.get(url.scheme)
        if not proxy or urllib.request.proxy_bypass_environment(url.host or "", proxies):
            return None
        if proxy not in self._proxied:
            self._proxied[proxy] = httpx.Client(proxy=proxy, **self._client_args)
        return self._proxied[proxy]

    def clone(self) -> "RegistryClient":
        """A client of its own for a background transfer (which may outlive the puller that started it)."""
        other = RegistryClient(self.name, self.insecure, self.options)
        other.token = self.token
        return other

    def _same_origin(self, url: httpx.URL) -> bool:
        port = url.port or (443 if url.scheme == "https" else 80)
        return (url.host or "").lower() == self.endpoint.host.lower() and port == self.endpoint.port

    def _send(self, url: httpx.URL, headers: dict[str, str]) -> httpx.Response:
        """One GET to a vetted IP (Host header and TLS SNI keep the real name)."""
        host = url.host or ""
        port = url.port or (443 if url.scheme == "https" else 80)
        ip = vet_address(host, port, implicitly_allowed=self.mirrored and self._same_origin(url))
        headers = {**headers, "Accept-Encoding": "identity", "User-Agent": "dgemma (ollama-compatible)"}
        proxied = self._proxy_client(url)
        if proxied is not None:  # the proxy resolves the name; the gate above still vetted it
            client, request = proxied, proxied.build_request("GET", url, headers=headers)
        else:
            headers["Host"] = url.netloc.decode("ascii")
            client = self.http
            request = client.build_request("GET", url.copy_with(host=ip), headers=headers,
                                           extensions={"sni_hostname": host} if url.scheme == "https" else {})
        try:
            return client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out talking to {host}") from exc
        except httpx.TransportError as exc:
            raise _Retryable(f"connection to {host} failed: {exc.__class__.__name__}") from exc

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """GET a registry path, answering one bearer challenge and following redirects by hand."""
        headers = dict(headers or {})
        resp = self._follow(self.endpoint.url(path), headers)
        if resp.status_code == 401 and "www-authenticate" in resp.headers:
            challenge = resp.headers["www-authenticate"]
            resp.close()
            self._fetch_token(challenge)
            resp = self._follow(self.endpoint.url(path), headers)
        return resp

    def _follow(self, url_text: str, headers: dict[str, str]) -> httpx.Response:
        url = httpx.URL(url_text)
        for _hop in range(MAX_REDIRECTS + 1):
            hop_headers = dict(headers)
            if self.token and self._same_origin(url):
                hop_headers["Authorization"] = f"Bearer {self.token}"
            resp = self._send(url, hop_headers)
            if resp.status_code not in (301, 302, 303, 307, 308):
                return resp
            location = resp.headers.get("location", "")
            resp.close()
            if not location:
                raise RegistryError(f"redirect without a location from {url.host}")
            nxt = httpx.URL(urljoin(str(url), location))
            if nxt.scheme not in ("http", "https"):
                raise RegistryError(f"refusing redirect to a {nxt.scheme!r} URL")
            if nxt.scheme == "http" and url.scheme == "https":
                raise RegistryError("refusing redirect from https to http")
            url = nxt
        raise RegistryError(f"too many redirects (more than {MAX_REDIRECTS})")

    def _fetch_token(self, challenge: str) -> None:
        params = _parse_challenge(challenge)
        realm = params.get("realm", "")
        parts = urlsplit(realm)
        if not parts.hostname:
            raise RegistryError("unauthorized: invalid authentication realm")
        if not _same_auth_host(parts.hostname, self.endpoint.host):
            raise RegistryError("unauthorized: realm host mismatch")
        if parts.scheme != "https" and not (parts.scheme == "http" and self.endpoint.scheme == "http"):
            raise RegistryError("unauthorized: realm must use https")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        url = realm + ("&" if "?" in realm else "?") + urlencode(query) if query else realm
        with self._token_lock:
            resp = self._send(httpx.URL(url), {"Accept": "application/json"})
            try:
                if resp.status_code != 200:
                    raise RegistryError(f"unauthorized: token request failed: {resp.status_code}")
                body = _read_capped(resp, MAX_TOKEN_BYTES, "token response")
            finally:
                resp.close()
            try:
                obj = json.loads(body)
            except ValueError:
                raise RegistryError("unauthorized: token response is not JSON") from None
            token = obj.get("token") or obj.get("access_token") if isinstance(obj, dict) else None
            if not isinstance(token, str) or not token:
                raise RegistryError("unauthorized: no token in the token response")
            self.token = token


# ---- blob transfers ------------------------------------------------------------------------------------------------

@dataclass
class _Part:
    n: int
    offset: int
    size: int
    completed: int = 0

    def state(self) -> dict[str, int]:
        return {"N": self.n, "Offset": self.offset, "Size": self.size, "Completed": self.completed}


class _Transfer:
    """One download of one blob, shared by every concurrent puller of that digest in this process."""

    def __init__(self, key: tuple[str, str], store: Store, client: RegistryClient, layer: Layer,
                 options: PullOptions) -> None:
        self.key, self.store, self.client, self.layer, self.options = key, store, client, layer, options
        self.total = layer.size
        self.completed = 0
        self.phase = "downloading"
        self.waiters = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancel = threading.Event()  # every interested puller has gone
        self._abort = threading.Event()  # a sibling part failed for good: stop the other parts
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pull-{layer.digest[7:19]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _add(self, n: int) -> None:
        with self._lock:
            self.completed += n

    def _run(self) -> None:
        try:
            self._download()
        except OSError as exc:  # disk trouble: a one-line error without the store path
            reason = exc.strerror or exc.__class__.__name__
            self.error = PullError(f"download of {self.layer.digest[:19]} failed: {reason}")
        except BaseException as exc:  # noqa: BLE001 (handed to every waiting puller)
            self.error = exc
        finally:
            self.client.close()
            with _transfers_lock:
                _transfers.pop(self.key, None)
            self.done.set()

    # -- layout and resume --

    def _layout(self) -> list[_Part]:
        size = self.options.part_size_for(self.total)
        n = math.ceil(self.total / size) if self.total else 0
        return [_Part(i, i * size, min(size, self.total - i * size)) for i in range(n)]

    def _load_sidecar(self, part: _Part) -> None:
        """Trust a sidecar only if it describes exactly this part; anything else means redo the part."""
        try:
            with open(self.store.sidecar_path(self.layer.digest, part.n), "rb") as f:
                state = json.loads(f.read(4096))
        except (OSError, ValueError):
            return
        if not isinstance(state, dict):
            return
        done = state.get("Completed")
        if (state.get("N") == part.n and state.get("Offset") == part.offset and state.get("Size") == part.size
                and isinstance(done, int) and not isinstance(done, bool) and 0 <= done <= part.size):
            part.completed = done

    def _save_sidecar(self, part: _Part) -> None:
        path = self.store.sidecar_path(self.layer.digest, part.n)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(json.dumps(part.state()).encode())
        os.replace(tmp, path)

    def _remove_sidecars(self) -> None:
        prefix = self.store.blob_path(self.layer.digest).name + "-partial-"
        for entry in self.store.blobs_dir.glob(prefix + "*"):
            suffix = entry.name[len(prefix):].removesuffix(".tmp")
            if suffix.isdigit():
                self.store.sidecar_path(self.layer.digest, int(suffix)).unlink(missing_ok=True)
                entry.unlink(missing_ok=True)

    def _prepare(self) -> list[_Part]:
        partial = self.store.partial_path(self.layer.digest)
        parts = self._layout()
        if partial.is_file() and partial.stat().st_size == self.total:
            for part in parts:
                self._load_sidecar(part)
        else:
            self._remove_sidecars()
            with open(partial, "wb") as f:
                f.truncate(self.total)  # sparse, pre-sized: parts write at their offsets
        for part in parts:
            self._save_sidecar(part)
        self.completed = sum(p.completed for p in parts)
        return parts

    # -- download --

    def _download(self) -> None:
        store, digest = self.store, self.layer.digest
        store.ensure_dirs()
        if store.has_blob(digest):
            self.completed = self.total
            return
        parts = self._prepare()
        partial = store.partial_path(digest)
        fd = os.open(partial, os.O_RDWR)
        try:
            try:
                self._run_parts(fd, [p for p in parts if p.completed < p.size])
            except _RangeNotSupported:
                self._remove_sidecars()
                whole = _Part(0, 0, self.total)
                self.completed = 0
                self._abort.clear()
                self._with_retries(lambda: self._fetch(fd, whole, ranged=False))
        finally:
            os.close(fd)
        self.phase = "verifying"
        got = sha256_file(partial)
        if got != digest:
            partial.unlink(missing_ok=True)
            self._remove_sidecars()
            raise RegistryError(f"digest mismatch, file must be downloaded again: want {digest}, got {got}")
        store.commit_blob(partial, digest)
        self._remove_sidecars()

    def _run_parts(self, fd: int, parts: list[_Part]) -> None:
        if not parts:
            return
        errors: list[BaseException] = []
        queue = list(parts)
        lock = threading.Lock()
        self._abort.clear()

        def worker() -> None:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    part = queue.pop(0)
                try:
                    self._with_retries(lambda: self._fetch(fd, part, ranged=True))
                except BaseException as exc:  # noqa: BLE001
                    with lock:
                        errors.append(exc)
                    self._abort.set()
                    return

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(self.options.streams, len(parts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # A range refusal wins over the errors it caused in sibling parts.
            raise next((e for e in errors if isinstance(e, _RangeNotSupported)), errors[0])

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise PullCancelled()
        if self._abort.is_set():
            raise PullError("download aborted")

    def _with_retries(self, attempt: Callable[[], None]) -> None:
        failures = 0
        while True:
            self._check_cancel()
            try:
                attempt()
                return
            except _Retryable as exc:
                failures += 1
                if failures > self.options.retries:
                    raise RegistryError(f"download of {self.layer.digest[:19]} failed: {exc}") from None
                deadline = time.monotonic() + self.options.backoff * 2 ** (failures - 1)
                while time.monotonic() < deadline:
                    self._check_cancel()
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _fetch(self, fd: int, part: _Part, ranged: bool) -> None:
        """Download the missing bytes of one part into the partial file at its offset."""
        if ranged:
            start, end = part.offset + part.completed, part.offset + part.size - 1
            if start > end:
                return
            headers = {"Range": f"bytes={start}-{end}"}
        else:
            part.completed, start, end = 0, 0, self.total - 1
            headers = {}
        path = f"/v2/{self.client.name.namespace}/{self.client.name.model}/blobs/{self.layer.digest}"
        resp = self.client.get(path, headers)
        try:
            status = resp.status_code
            if status in (408, 429) or status >= 500:
                raise _Retryable(f"{status} from registry")
            if status >= 400:
                raise RegistryError(f"download of {self.layer.digest[:19]} failed: {status}: {_error_snippet(resp)}")
            if ranged and status == 200:
                raise _RangeNotSupported()
            if ranged and status != 206 or not ranged and status != 200:
                raise RegistryError(f"unexpected status {status} for a blob request")
            expected = end - start + 1
            if ranged:
                content_range = resp.headers.get("content-range", "")
                m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
                if not m or int(m[1]) != start or int(m[2]) != end or (m[3] != "*" and int(m[3]) != self.total):
                    raise RegistryError(f"registry sent Content-Range {content_range!r} for bytes {start}-{end}")
            length = resp.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) != expected):
                raise RegistryError(f"registry sent Content-Length {length} for {expected} bytes")
            encoding = resp.headers.get("content-encoding", "identity").lower()
            if encoding not in ("", "identity"):
                raise RegistryError(f"unexpected content encoding {encoding!r} for a blob")
            self._copy_body(fd, resp, part, start, expected)
        finally:
            resp.close()
            self._save_sidecar(part)

    def _copy_body(self, fd: int, resp: httpx.Response, part: _Part, start: int, expected: int) -> None:
        received, last_save = 0, time.monotonic()
        try:
            for chunk in resp.iter_raw():
                self._check_cancel()
                if received + len(chunk) > expected:
                    raise _Retryable("registry sent more bytes than requested")
                try:
                    os.pwrite(fd, chunk, start + received)
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        raise PullError("no space left on device") from None
                    raise
                received += len(chunk)
                part.completed += len(chunk)
                self._add(len(chunk))
                if time.monotonic() - last_save > 0.5:
                    self._save_sidecar(part)
                    last_save = time.monotonic()
        except httpx.TimeoutException as exc:
            raise _Retryable("no data received within the stall timeout") from exc
        except httpx.TransportError as exc:
            raise _Retryable(f"connection lost: {exc.__class__.__name__}") from exc
        if received < expected:
            raise _Retryable(f"connection closed after {received} of {expected} bytes")


_transfers: dict[tuple[str, str], _Transfer] = {}
_transfers_lock = threading.Lock()


def _join_transfer(store: Store, client: RegistryClient, layer: Layer, options: PullOptions) -> _Transfer:
    """Join the running download of this digest, or start one (after a cancelled one has fully stopped)."""
    key = (str(store.blobs_dir.resolve()), layer.digest)
    while True:
        with _transfers_lock:
            transfer = _transfers.get(key)
            if transfer is None:
                transfer = _Transfer(key, store, client.clone(), layer, options)
                _transfers[key] = transfer
                transfer.waiters = 1
                transfer.start()
                return transfer
            if not transfer.cancel.is_set():
                transfer.waiters += 1
                return transfer
        transfer.done.wait()  # a cancelled transfer still owns the partial file until it stops


def _leave_transfer(transfer: _Transfer) -> None:
    with _transfers_lock:
        transfer.waiters -= 1
        if transfer.waiters <= 0 and not transfer.done.is_set():
            transfer.cancel.set()  # the last interested client has gone


# ---- the pull ------------------------------------------------------------------------------------------------------

def _cancel_check(cancel: Any) -> Callable[[], bool]:
    if cancel is None:
        return lambda: False
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    return cancel


def _progress(layer: Layer, completed: int) -> dict[str, Any]:
    event: dict[str, Any] = {"status": f"pulling {layer.digest[7:19]}", "digest": layer.digest, "total": layer.size}
    if completed:
        event["completed"] = completed
    return event


def _fetch_manifest(client: RegistryClient) -> bytes:
    name = client.name
    try:
        resp = client.get(f"/v2/{name.namespace}/{name.model}/manifests/{name.tag}", {"Accept": MANIFEST_MEDIA_TYPE})
    except _Retryable as exc:
        raise RegistryError(f"pull model manifest: {exc}") from None
    try:
        if resp.status_code == 404:
            raise ManifestNotFoundError("pull model manifest: file does not exist")
        if resp.status_code == 401:
            raise RegistryError("pull model manifest: 401: unauthorized")
        if resp.status_code >= 400:
            raise RegistryError(f"pull model manifest: {resp.status_code}: {_error_snippet(resp)}")
        if resp.status_code != 200:
            raise RegistryError(f"pull model manifest: unexpected status {resp.status_code}")
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_MANIFEST_BYTES:
            raise RegistryError("manifest is too large (more than 4 MiB)")
        try:
            return _read_capped(resp, MAX_MANIFEST_BYTES, "manifest")
        except httpx.HTTPError as exc:
            raise RegistryError(f"pull model manifest: {exc.__class__.__name__}") from None
    finally:
        resp.close()


def _fetch_config(client: RegistryClient, store: Store, layer: Layer) -> dict[str, Any]:
    """Fetch (or read) the small config blob and return it parsed."""
    if layer.size > MAX_CONFIG_BYTES:
        raise RegistryError("config blob is too large")
    if not store.has_blob(layer.digest):
        name = client.name
        try:
            resp = client.get(f"/v2/{name.namespace}/{name.model}/blobs/{layer.digest}")
        except _Retryable as exc:
            raise RegistryError(f"pull config: {exc}") from None
        try:
            if resp.status_code != 200:
                raise RegistryError(f"pull config: {resp.status_code}: {_error_snippet(resp)}")
            data = _read_capped(resp, MAX_CONFIG_BYTES, "config blob")
        except httpx.HTTPError as exc:
            raise RegistryError(f"pull config: {exc.__class__.__name__}") from None
        finally:
            resp.close()
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != layer.digest:
            raise RegistryError(f"digest mismatch, file must be downloaded again: want {layer.digest}, got {got}")
        store.write_blob(data)
    try:
        config = json.loads(store.read_blob_text(layer.digest, MAX_CONFIG_BYTES))
    except ValueError:
        raise RegistryError("config blob is not valid JSON") from None
    if not isinstance(config, dict):
        raise RegistryError("config blob is not a JSON object")
    family = config.get("model_family")
    families = config.get("model_families") or []
    if family:  # a config without one is judged by its model layer's GGUF (check_model_gguf)
        check_architecture(family, families=families, error=PullRefused)
    if config.get("requires") is not None:
        _checked_layer("config", lambda: check_requires(config["requires"]))
    return config


def _check_manifest_shape(manifest: Manifest) -> Layer:
    models = [layer for layer in manifest.layers if layer.media_type == MEDIA_MODEL]
    if len(models) != 1:
        if len(models) > 1:
            raise PullRefused("split GGUF models (more than one model layer) are not supported")
        raise PullRefused("invalid manifest: no model layer")
    if len({layer.digest for layer in manifest.layers}) != len(manifest.layers):
        raise PullRefused("invalid manifest: repeated layer digest")
    for layer in manifest.layers:
        if layer.media_type in TEXT_LAYERS and layer.size > MAX_TEXT_LAYER_BYTES:
            what = TEXT_LAYERS[layer.media_type]
            raise PullRefused(f"invalid {what} layer: larger than {MAX_TEXT_LAYER_BYTES} bytes")
    return models[0]


# The small layers a model's settings live in, by what errors call them; each is checked as create checks the same
# Modelfile line, before the weights are downloaded.
TEXT_LAYERS = {MEDIA_TEMPLATE: "template", MEDIA_SYSTEM: "system", MEDIA_LICENSE: "license", MEDIA_PARAMS: "params",
               MEDIA_MESSAGES: "messages"}


def _checked_layer(what: str, check: Callable[[], Any]) -> None:
    try:
        check()
    except DgemmaError as exc:
        raise PullRefused(f"invalid {what} layer: {exc}"[:300]) from None


def _json_layer(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise DgemmaError("not valid JSON") from None


def check_text_layer(media_type: str, text: str) -> None:
    """A downloaded template/system/license/params/messages layer, by the functions that check the Modelfile's
    TEMPLATE, SYSTEM, LICENSE, PARAMETER and MESSAGE lines at create: PullRefused (400) naming the problem."""
    what = TEXT_LAYERS[media_type]
    if media_type == MEDIA_TEMPLATE:
        _checked_layer(what, lambda: check_template(text))
    elif media_type == MEDIA_PARAMS:
        _checked_layer(what, lambda: check_parameters(_json_layer(text)))
    elif media_type == MEDIA_MESSAGES:
        _checked_layer(what, lambda: check_messages(_json_layer(text)))
    else:
        _checked_layer(what, lambda: quote(text))


def _download(store: Store, client: RegistryClient, layer: Layer, options: PullOptions,
              cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
    """One layer into the store (joining a running transfer of the same digest), with its progress objects."""
    if store.has_blob(layer.digest):
        yield _progress(layer, layer.size)
        return
    transfer = _join_transfer(store, client, layer, options)
    try:
        last = -1
        yield _progress(layer, transfer.completed)
        while not transfer.done.wait(options.progress_interval):
            if cancelled():
                raise PullCancelled()
            if transfer.completed != last:
                last = transfer.completed
                yield _progress(layer, last)
        if transfer.error is not None:
            raise transfer.error
        yield _progress(layer, layer.size)
    finally:
        _leave_transfer(transfer)


def pull(name: ModelName | str, store: Store, insecure: bool = False, cancel: Any = None,
         options: PullOptions | None = None) -> Iterator[dict[str, Any]]:
    """Pull `name` into `store`, yielding Ollama's progress objects; raises a DgemmaError subclass on failure.

    `cancel`: a threading.Event (or a callable returning True) that stops the pull; finished parts are kept so a
    later pull resumes. Closing the generator has the same effect."""
    model_name = name if isinstance(name, ModelName) else ModelName.parse(name)
    options = options or PullOptions.from_env()
    client = RegistryClient(model_name, insecure, options)
    try:
        yield from _pull(model_name, store, client, options, _cancel_check(cancel))
    except OSError as exc:
        raise PullError(f"pull failed: {exc.strerror or exc.__class__.__name__}") from None
    finally:
        client.close()


def _pull(model_name: ModelName, store: Store, client: RegistryClient, options: PullOptions,
          cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
    yield {"status": "pulling manifest"}
    raw = _fetch_manifest(client)
    manifest = parse_manifest(raw)
    model_layer = _check_manifest_shape(manifest)

    yield _progress(manifest.config, 0)
    try:
        _fetch_config(client, store, manifest.config)
    except PullRefused:
        store.remove_unreferenced([manifest.config.digest])
        raise
    yield _progress(manifest.config, manifest.config.size)

    store.ensure_dirs()
    missing = [layer for layer in manifest.layers if not store.has_blob(layer.digest)]
    needed = sum(layer.size for layer in missing)
    free = shutil.disk_usage(store.blobs_dir).free
    if needed and free < needed + options.free_disk_margin:
        raise PullError(f"insufficient disk space: need {needed + options.free_disk_margin} bytes, {free} free")

    # the settings layers first: a model whose messages, params or template create would refuse is refused before
    # its weights are downloaded, and leaves nothing behind
    small = [layer for layer in manifest.layers if layer.media_type in TEXT_LAYERS]
    for layer in small:
        yield from _download(store, client, layer, options, cancelled)
    try:
        for layer in small:
            check_text_layer(layer.media_type, store.read_blob_text(layer.digest))
    except PullRefused:
        store.remove_unreferenced([manifest.config.digest, *(layer.digest for layer in small)])
        raise
    for layer in manifest.layers:
        if layer.media_type not in TEXT_LAYERS:
            yield from _download(store, client, layer, options, cancelled)
    # Each transfer hashed its file before moving it into place; a pull that joined another's transfer
    # relies on that, so here we only confirm every layer is present.
    yield {"status": "verifying sha256 digest"}
    for layer in manifest.layers:
        if not store.has_blob(layer.digest):
            raise RegistryError(f"layer {layer.digest[:19]} is missing after download")
    projectors = [layer for layer in manifest.layers if layer.media_type == MEDIA_PROJECTOR]
    try:  # what create checks: a model and a projector the store keeps can run
        info = check_model_gguf(store.blob_path(model_layer.digest))
        for layer in projectors:
            check_projector(store.blob_path(layer.digest), info, f"layer {layer.digest[:19]}")
    except DgemmaError:
        store.remove_unreferenced([model_layer.digest, *(layer.digest for layer in projectors)])
        raise

    yield {"status": "writing manifest"}
    with store.write_lock():  # no concurrent create/delete/prune removes a layer between this check and the write
        missing = store.missing_blobs(manifest)
        if missing:
            raise RegistryError(f"layer {missing[0][:19]} is missing after download")
        replaced = store.replace_manifest(model_name, raw)
    if replaced:
        yield {"status": "removing unused layers"}
    yield {"status": "success"}
