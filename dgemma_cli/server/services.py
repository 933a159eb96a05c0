"""What the routes share: configuration, the store, the scheduler, the schema compiler, and model names resolved to
stored models."""
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgemma_engine.arch import check_architecture
from starlette.requests import Request

from dgemma_cli.bundled import bundled_source
from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import ModelName
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.response_store import ResponseStore
from dgemma_cli.server.scheduler import Scheduler
from dgemma_cli.store import ModelNotFoundError, Store

log = logging.getLogger("dgemma.server")


@dataclass
class ResolvedModel:
    name: ModelName
    local: Any  # the store's LocalModel
    requested: str = ""  # the name as the request wrote it

    def __post_init__(self):
        self.display = self.local.name  # the stored model's name, as `ps` and answers show it
        self.full = self.name.full

    @property
    def quoted(self) -> str:
        """The name as sent, Go-quoted, for capability errors (`"m" does not support thinking`)."""
        return '"' + self.requested.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Services:
    def __init__(self, config: ServerConfig, store: Store, scheduler: Scheduler, dgemma_version: str,
                 schemas: Any = None):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.dgemma_version = dgemma_version
        self.schemas = schemas  # compiles structured-output formats (server/schema_compiler.py)
        self.responses = ResponseStore()  # recent /v1/responses answers (server/response_store.py)

    def parse_name(self, text: str, message: str | None = None) -> ModelName:
        try:
            return ModelName.parse(text)
        except DgemmaError:
            raise RequestError(message or "invalid model name") from None

    def blob_path(self, digest: str) -> Path:
        return self.store.blob_path(digest)  # THE validator (400 invalid digest format)

    async def resolve(self, text: str) -> ResolvedModel:
        name = self.parse_name(text)
        try:
            local = await asyncio.to_thread(self.store.resolve, name)
        except ModelNotFoundError:
            missing = ModelNotFoundError(text)  # named as the client wrote it, as Ollama does
            # a bundled model (sudoku) comes from the package on first use: no pull, no network; registered in the
            # store, or served from a private copy by a read-only server, which writes nothing there
            source = await asyncio.to_thread(bundled_source, self.store, name, self.config.readonly)
            if source is None:
                raise missing from None
            local = await asyncio.to_thread(source.resolve, name)
        return ResolvedModel(name=name, local=local, requested=text)

    async def resolve_runnable(self, text: str) -> ResolvedModel:
        model = await self.resolve(text)
        family = (model.local.config or {}).get("model_family")
        if family:  # a manifest without one is checked by its GGUF when it loads
            check_architecture(family, error=RequestError)
        if model.local.gguf_path is None:
            raise RequestError(f"model '{model.display}' has no model layer")
        return model


def services(request: Request) -> Services:
    return request.app.state.services
