"""The route class of both API routers: every JSON body goes through `validation.parse_body` (docs/server.md)."""
import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.validation import parse_body

THREADED_PARSE_BYTES = 1 << 20  # larger bodies are parsed off the event loop


class CheckedRequest(Request):
    """A request whose `json()` is `parse_body`: FastAPI reads every body through it."""

    async def json(self) -> Any:
        if not hasattr(self, "_checked_json"):
            body = await self.body()
            try:
                if len(body) > THREADED_PARSE_BYTES:
                    self._checked_json = await asyncio.to_thread(parse_body, body)
                else:
                    self._checked_json = parse_body(body)
            except DgemmaError as exc:  # FastAPI turns other exceptions from here into a generic 400
                raise HTTPException(exc.status, str(exc)) from None
        return self._checked_json


class CheckedRoute(APIRoute):
    """The route class of both API routers: their handlers receive a `CheckedRequest`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked
