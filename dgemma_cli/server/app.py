"""The FastAPI application: routes, error rendering, security middleware, lifespan (store pruning, unloading)."""
import contextlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dgemma_cli import __version__
from dgemma_cli.errors import DgemmaError
from dgemma_cli.server import ollama_routes, openai_routes, responses_routes
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.runner import EngineRunner
from dgemma_cli.server.scheduler import RunnerFactory, Scheduler
from dgemma_cli.server.schema_compiler import SchemaCompiler
from dgemma_cli.server.security import SecurityMiddleware, error_body
from dgemma_cli.server.services import Services
from dgemma_cli.server.streaming import error_message, error_status

log = logging.getLogger("dgemma.server")


def default_runner_factory(local_model: Any, num_ctx: int) -> EngineRunner:
    """Validate the GGUF in Python first (docs/compat.md, security D10), then hand it to the native loader."""
    from dgemma_cli.gguf_check import check_diffusion_gguf

    check_diffusion_gguf(local_model.gguf_path)
    return EngineRunner(local_model, num_ctx)


class JsonBodyMiddleware:
    """Request bodies are JSON whatever `Content-Type` says: clients often omit it (docs/compat.md#rest-conventions),
    and FastAPI would otherwise refuse to parse them. Blob uploads are raw bytes and keep their headers."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS") and not scope["path"].startswith(
            "/api/blobs/"
        ):
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """Unexpected exceptions become a path-free `500 {"error": ...}` and the connection stays usable (Starlette's own
    last-resort handler re-raises into the server, which drops the keep-alive connection)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # the client left mid-body (an upload, say); nobody is left to answer
            log.info("client left during the request body of %s", scope.get("path"))
        except Exception as exc:  # noqa: BLE001  (last resort; routes raise DgemmaError for known failures)
            log.error("internal error on %s", scope.get("path"), exc_info=exc)
            if started:
                return
            status = error_status(exc)
            body = error_body(scope.get("path", ""), status, error_message(exc))
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def _error_response(request: Request, status: int, message: str) -> Response:
    return Response(error_body(request.url.path, status, message), status_code=status, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> str:
    """One line like Ollama's: a missing body, bad JSON (with the parser's message), or the first wrong field."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    kind = first.get("type", "")
    loc = []
    for part in first.get("loc", ())[1:]:  # ("body", field, ...); union members add type tags such as "int"
        if isinstance(part, str) and (part in ("int", "float", "str", "bool", "none") or "[" in part):
            break
        loc.append(str(part))
    if kind == "missing" and not loc:
        return "missing request body"
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"invalid JSON: {ctx.get('error', first.get('msg', 'malformed body'))}"
    if kind == "model_attributes_type" or (not loc and kind.endswith("_type")):
        return "request body must be a JSON object"
    field = ".".join(loc) or "body"
    return f"invalid value for {field}: {first.get('msg', 'wrong type')}"


def _fix_openapi(app: FastAPI) -> dict[str, Any]:
    """The schema FastAPI derives, with validation failures documented as our 400 (never 422)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title="dgemma", version=__version__, routes=app.routes,
                         description="Ollama- and OpenAI-compatible API for DiffusionGemma")
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}

    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error_ref}}}

    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            had_validation = responses.pop("422", None) is not None
            if had_validation and "400" not in responses:
                responses["400"] = error("invalid request")
            # Answered by the middleware on any route (docs/compat.md, security F, G): API key, Host/Origin or read-only
            # refusal, body cap.
            if path != "/":
                responses.setdefault("401", error("DGEMMA_API_KEY is set and the bearer token is missing or wrong"))
            responses.setdefault("403", {"description": "Host or Origin not allowed (empty body), or read-only mode"})
            if method in ("post", "put", "patch", "delete"):
                responses.setdefault("413", error("request body too large"))
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema


def create_app(
    config: ServerConfig | None = None,
    store: Any = None,
    runner_factory: RunnerFactory | None = None,
    schemas: Any = None,
    precompile_formats: bool = True,
) -> FastAPI:
    """`schemas`: what compiles structured-output formats (a SchemaCompiler over the store's cache by default);
    `precompile_formats`: compile "any JSON object" in the background when a model loads."""
    from dgemma_cli.store import Store

    config = config or ServerConfig.from_env()
    store = store if store is not None else Store(config.models_dir)
    if schemas is None:
        schemas = SchemaCompiler(Path(store.root) / "cache" / "automata", config.schema_compile_timeout,
                                 read_only=config.readonly)
    scheduler = Scheduler(config, runner_factory or default_runner_factory,
                          on_loaded=schemas.precompile if precompile_formats else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not config.noprune and not config.readonly:  # a read-only server writes nothing in the store
            try:
                removed = store.prune()
                if removed:
                    log.info("pruned %d unused blob file(s)", len(removed))
            except (OSError, DgemmaError) as exc:
                log.warning("store pruning failed: %s", error_message(exc))
        yield
        await schemas.close()
        await scheduler.shutdown()

    app = FastAPI(
        title="dgemma",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.services = Services(config, store, scheduler, __version__, schemas)
    app.include_router(ollama_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.openapi = lambda: _fix_openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(request, 400, _validation_message(exc))

    @app.exception_handler(DgemmaError)
    async def on_user_error(request: Request, exc: DgemmaError) -> Response:
        return _error_response(request, error_status(exc), error_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(request, exc.status_code, str(exc.detail))

    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(SecurityMiddleware, config=config)  # outermost: refuses before anything else runs
    return app
