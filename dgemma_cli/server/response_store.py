"""The Responses API's state: recent responses kept in memory, so a later request can continue one
(`previous_response_id`), point at its items (`{"type": "item_reference", "id": …}`) or read and delete it
(`GET`/`DELETE /v1/responses/{id}`) (docs/server.md, "The Responses API").

Bounded three ways: at most KEPT responses, each for at most LIFETIME_S seconds, and at most MAX_BYTES of them in all
(their JSON size: input images count); the oldest go first. A response whose request said `store: false` is never
kept. Nothing survives a restart: a client that needs that sends the whole conversation each time.
"""
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from dgemma_cli.server.errors import NotFound

KEPT = 256
LIFETIME_S = 3600.0
MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was sent
    items: list[dict[str, Any]]  # the conversation it answered (input items, earlier responses resolved in); no
    # `instructions`, which a continuation does not inherit (as OpenAI)
    expires: float
    size: int

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a request continuing this response starts with: its input, then its output."""
        return self.items + list(self.response.get("output") or [])


class ResponseStore:
    def __init__(self, kept: int = KEPT, lifetime_s: float = LIFETIME_S, max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        self.kept, self.lifetime_s, self.max_bytes, self.clock = kept, lifetime_s, max_bytes, clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, str] = {}  # item id -> the response that holds it (the newest one)
        self._bytes = 0

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        size = len(json.dumps([response, items], ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a later reference to it is a 404)
        self.delete(response["id"])
        stored = StoredResponse(response, items, self.clock() + self.lifetime_s, size)
        self._responses[response["id"]] = stored
        self._bytes += size
        for item in stored.conversation:
            if isinstance(item.get("id"), str):
                self._items[item["id"]] = response["id"]
        self._expire()
        while len(self._responses) > self.kept or self._bytes > self.max_bytes:
            self.delete(next(iter(self._responses)))

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._responses.get(response_id)

    def response(self, response_id: str) -> StoredResponse:
        """The stored response, else OpenAI's 404."""
        stored = self.get(response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id}' not found.")
        return stored

    def item(self, item_id: str) -> dict[str, Any]:
        """An input or output item of a stored response, by its id, else OpenAI's 404."""
        self._expire()
        holder = self._responses.get(self._items.get(item_id, ""))
        for item in holder.conversation if holder is not None else ():
            if item.get("id") == item_id:
                return item
        raise NotFound(f"Item with id '{item_id}' not found.")

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self._bytes -= stored.size
        for item in stored.conversation:
            if self._items.get(item.get("id")) == response_id:
                del self._items[item["id"]]
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._responses:
            oldest_id, oldest = next(iter(self._responses.items()))
            if oldest.expires > now:
                break
            self.delete(oldest_id)
