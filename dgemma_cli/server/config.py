"""Server configuration from `DGEMMA_*` environment variables (the table is `dgemma_cli/env.py`).

Every value remembers where it came from so `dgemma serve` can log the effective configuration and its sources.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError
from dgemma_cli.hosts import HostAddress, parse_host


@dataclass
class ServerConfig:
    """Effective server settings. `sources` maps each setting to the variable that supplied it (or `default`)."""

    host: HostAddress = env.HOST.default
    models_dir: str | None = env.MODELS.default  # None: the store's own default (~/.dgemma/models)
    keep_alive: float = env.KEEP_ALIVE.default  # seconds; FOREVER = never unload
    origins: tuple[str, ...] = env.ORIGINS.default
    num_parallel: int = env.NUM_PARALLEL.default
    max_queue: int = env.MAX_QUEUE.default
    max_loaded_models: int = env.MAX_LOADED_MODELS.default
    context_length: int = env.CONTEXT_LENGTH.default
    load_timeout: float = env.LOAD_TIMEOUT.default  # seconds; <= 0: none
    debug: int = env.DEBUG.default
    noprune: bool = env.NOPRUNE.default
    api_key: str | None = env.API_KEY.default
    readonly: bool = env.READONLY.default
    allowed_hosts: tuple[str, ...] = env.ALLOWED_HOSTS.default
    max_upload: int = env.MAX_UPLOAD.default
    max_canvases: int = env.MAX_CANVASES.default
    max_images: int = env.MAX_IMAGES.default
    max_steps: int = env.MAX_STEPS.default
    compat_version: str = env.COMPAT_VERSION.default
    schema_compile_timeout: float = env.SCHEMA_COMPILE_TIMEOUT.default  # CPU seconds
    header_timeout: float = env.HEADER_TIMEOUT.default  # seconds (http_limits.py)
    body_timeout: float = env.BODY_TIMEOUT.default  # seconds
    max_connections: int = env.MAX_CONNECTIONS.default  # lowered under the open-file limit (http_limits.py)
    max_json_body: int = 32 * 2**20
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServerConfig":
        config = cls()
        for var in env.SERVER:
            config.sources[var.setting] = "default"
            raw = var.raw(environ)
            if raw is None:
                continue
            # The host parser also reports a bad port (and keeps the default port): the startup log shows it.
            parse = partial(parse_host, warnings=config.warnings) if var is env.HOST else var.parse
            try:
                setattr(config, var.setting, parse(env.clean(raw)))
                config.sources[var.setting] = var.name
            except (DgemmaError, ValueError) as exc:
                config.warnings.append(f"ignoring {var.name}={raw!r}: {exc}")
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
            elif attribute == "models_dir" and value is None:
                from dgemma_cli.store import default_root

                value = default_root()  # the path the store will use, not "None"
            lines.append(f"{attribute}={value} ({source})")
        return lines
