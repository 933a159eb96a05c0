"""Server addresses: the `DGEMMA_HOST` grammar (`[scheme://]host[:port]`) and the loopback test.

Neutral ground: the server binds to what `parse_host` reads, the client connects to it, and the registry's SSRF gate
asks `is_loopback_host`; none of them has to import the others for it.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DEFAULT_PORT = 11435
DEFAULT_HOST = f"127.0.0.1:{DEFAULT_PORT}"


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostAddress:
    """Where the server listens (and clients connect): `scheme://host:port`."""

    scheme: str
    host: str
    port: int

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_host(value: str, warnings: list[str] | None = None) -> HostAddress:
    """`[scheme://]host[:port][/path]` per docs/compat.md#environment. An empty host means loopback (unlike Ollama,
    never all interfaces)."""
    text = value.strip()
    scheme = "http"
    explicit_scheme = False
    if "://" in text:
        scheme, text = text.split("://", 1)
        scheme = scheme.lower() or "http"
        explicit_scheme = True
    text = text.split("/", 1)[0]
    default_port = {"http": 80, "https": 443}.get(scheme, DEFAULT_PORT) if explicit_scheme else DEFAULT_PORT
    port_text = ""
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        host = text[1:end] if end > 0 else text[1:]
        rest = text[end + 1 :] if end > 0 else ""
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:  # a bare name, IPv4 or unbracketed IPv6
        host = text
    port = default_port
    if port_text:
        if port_text.isdigit() and 0 <= int(port_text) <= 65535:
            port = int(port_text)
        elif warnings is not None:
            warnings.append(f"invalid port {port_text!r} in DGEMMA_HOST, using {default_port}")
    return HostAddress(scheme=scheme, host=host or "127.0.0.1", port=port)
