"""Server configuration from `DGEMMA_*` environment variables (spec ollama-compat.md §1.5).

Every value remembers where it came from so `dgemma serve` can log the effective configuration and its sources.
Only `DGEMMA_*` variables are read: a machine that also runs Ollama must not have dgemma bind its port or use its store.
"""
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from dgemma_cli.errors import DgemmaError
from dgemma_cli.registry import is_loopback_host
from dgemma_cli.server.durations import FOREVER, parse_keep_alive

DEFAULT_PORT = 11435
DEFAULT_HOST = f"127.0.0.1:{DEFAULT_PORT}"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


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
    """`[scheme://]host[:port][/path]` per §1.5. An empty host means loopback (unlike Ollama, never all interfaces)."""
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


def parse_bool(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise DgemmaError(f"invalid boolean {value!r}")


def parse_size(value: str) -> int:
    """Bytes from `128GB`, `512MiB`, `1000`: decimal and binary units, case-insensitive."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise DgemmaError(f"invalid size {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _clean(value: str) -> str:
    """Environment values are stripped of surrounding whitespace and quotes."""
    return value.strip().strip("\"'").strip()


@dataclass
class ServerConfig:
    """Effective server settings. `sources` maps each setting to the variable that supplied it (or `default`)."""

    host: HostAddress = field(default_factory=lambda: parse_host(DEFAULT_HOST))
    models_dir: str | None = None  # None: the store's own default (~/.dgemma/models)
    keep_alive: float = 300.0  # seconds; FOREVER = never unload
    origins: tuple[str, ...] = ()
    num_parallel: int = 1
    max_queue: int = 512
    max_loaded_models: int = 1
    context_length: int = 8192
    load_timeout: float = 300.0  # seconds; <= 0: none
    debug: int = 0
    noprune: bool = False
    api_key: str | None = None
    readonly: bool = False
    allowed_hosts: tuple[str, ...] = ()
    max_upload: int = 128 * 10**9
    max_canvases: int = 16
    max_steps: int = 256
    compat_version: str = "0.32.0"
    max_json_body: int = 32 * 2**20
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServerConfig":
        env = os.environ if environ is None else environ
        config = cls()
        readers = {
            "DGEMMA_HOST": ("host", lambda v: parse_host(v, config.warnings)),
            "DGEMMA_MODELS": ("models_dir", lambda v: os.path.expanduser(v)),
            "DGEMMA_KEEP_ALIVE": ("keep_alive", _keep_alive_env),
            "DGEMMA_ORIGINS": ("origins", _comma_list),
            "DGEMMA_NUM_PARALLEL": ("num_parallel", _positive_int),
            "DGEMMA_MAX_QUEUE": ("max_queue", _positive_int),
            "DGEMMA_MAX_LOADED_MODELS": ("max_loaded_models", _positive_int),
            "DGEMMA_CONTEXT_LENGTH": ("context_length", _positive_int),
            "DGEMMA_LOAD_TIMEOUT": ("load_timeout", _load_timeout_env),
            "DGEMMA_DEBUG": ("debug", lambda v: 2 if v.strip() == "2" else int(parse_bool(v))),
            "DGEMMA_NOPRUNE": ("noprune", parse_bool),
            "DGEMMA_API_KEY": ("api_key", lambda v: v or None),
            "DGEMMA_READONLY": ("readonly", parse_bool),
            "DGEMMA_ALLOWED_HOSTS": ("allowed_hosts", _comma_list),
            "DGEMMA_MAX_UPLOAD": ("max_upload", parse_size),
            "DGEMMA_MAX_CANVASES": ("max_canvases", _positive_int),
            "DGEMMA_MAX_STEPS": ("max_steps", _positive_int),
            "DGEMMA_COMPAT_VERSION": ("compat_version", _dotted_version),
        }
        for variable, (attribute, parse) in readers.items():
            config.sources[attribute] = "default"
            raw = env.get(variable)
            if raw is None:
                continue
            try:
                setattr(config, attribute, parse(_clean(raw)))
                config.sources[attribute] = variable
            except (DgemmaError, ValueError) as exc:
                config.warnings.append(f"ignoring {variable}={raw!r}: {exc}")
        return config

    def describe(self) -> list[str]:
        """One `name=value (source)` line per setting, for the startup log. The API key itself is never shown."""
        lines = []
        for attribute, source in self.sources.items():
            value = getattr(self, attribute)
            if attribute == "api_key":
                value = "set" if value else "unset"
            elif attribute == "host":
                value = value.url
            lines.append(f"{attribute}={value} ({source})")
        return lines


def _keep_alive_env(value: str) -> float:
    seconds = parse_keep_alive(value)
    return 300.0 if seconds is None else seconds


def _load_timeout_env(value: str) -> float:
    seconds = parse_keep_alive(value)
    return 0.0 if seconds is None or seconds == FOREVER else seconds


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def _dotted_version(value: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)*", value):
        raise ValueError("must be a dotted number such as 0.32.0")
    return value
