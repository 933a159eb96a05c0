"""Drive a running Open WebUI with headless Chromium (Playwright): one chat per model with default settings,
screenshots, then the chat as Open WebUI stored it (answer, title, tags) read back through its own API.

Run by bench/openwebui_check.sh inside Open WebUI's venv (which has playwright); not part of the test suite.

    python bench/openwebui_driver.py --webui http://127.0.0.1:8080 --out DIR --chromium /usr/bin/chromium \
        --chat "sudoku:latest=530070000600195000098000060800060003400803001700020006060000280000419005000080079" \
        --chat "tiny-tools:latest=What is the weather in Paris?" \
        --chat "tiny-vision:latest=What is in this picture?" --image "tiny-vision:latest=tests/fixtures/tiny-v/images/square.png"

Prints one JSON line per chat and exits 1 when a chat got no answer or its title/tags never arrived.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from playwright.sync_api import Page, sync_playwright

DEFAULT_TITLE = "New Chat"
SETTLE_S = 20


@dataclass
class ChatResult:
    model: str
    prompt: str
    chat_id: str = ""
    answer: str = ""
    error: str = ""
    title: str = ""
    tags: list[str] = field(default_factory=list)
    follow_ups: list[str] = field(default_factory=list)
    images_sent: int = 0
    screenshots: list[str] = field(default_factory=list)

    @property
    def title_generated(self) -> bool:
        """The title came from the model (Open WebUI falls back to the prompt when the answer is not usable JSON)."""
        return self.title not in ("", DEFAULT_TITLE, self.prompt)

    @property
    def ok(self) -> bool:
        return bool(self.answer) and not self.error and self.title not in ("", DEFAULT_TITLE)


def api(page: Page, path: str) -> object:
    """GET an Open WebUI API path with the browser's session token (auth is off, but the API still wants one)."""
    return page.evaluate(
        """async (path) => {
            const r = await fetch(path, {headers: {Authorization: `Bearer ${localStorage.token}`}});
            return r.ok ? await r.json() : {status: r.status, text: await r.text()};
        }""", path)


def dismiss_popups(page: Page) -> None:
    """The first visit shows a changelog / welcome dialog: close whatever is in the way."""
    for label in ("Okay, Let's Go!", "Get started", "Close"):
        button = page.get_by_role("button", name=label)
        if button.count():
            try:
                button.first.click(timeout=2000)
            except Exception:  # noqa: BLE001  (not clickable: not in the way either)
                pass
    page.keyboard.press("Escape")


def shot(page: Page, out: Path, name: str, result: ChatResult) -> None:
    path = out / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    result.screenshots.append(str(path))


def latest_assistant(chat: dict) -> dict:
    messages = chat.get("history", {}).get("messages", {}) or {}
    replies = [m for m in messages.values() if m.get("role") == "assistant"]
    return max(replies, key=lambda m: m.get("timestamp", 0)) if replies else {}


def attach_image(page: Page, image: Path) -> None:
    """Upload an image through the chat box's file input, as the paperclip menu does, and wait for its preview."""
    page.locator('input[type="file"]').first.set_input_files(str(image))
    page.wait_for_selector(f'img[alt="{image.name}"], img[src^="data:image"], img[src*="/files/"]', timeout=30_000)


def sent_images(chat: dict) -> int:
    """Images on the chat's user messages, as Open WebUI stored them (0.12: a file whose content type is an image)."""
    messages = chat.get("history", {}).get("messages", {}) or {}
    return sum(1 for m in messages.values() if m.get("role") == "user" for f in (m.get("files") or [])
               if f.get("type") == "image" or str(f.get("content_type", "")).startswith("image/"))


def run_chat(page: Page, base: str, out: Path, model: str, prompt: str, timeout: float,
             image: Path | None = None) -> ChatResult:
    result = ChatResult(model=model, prompt=prompt)
    slug = model.replace(":", "_").replace("/", "_")
    page.goto(f"{base}/?models={quote(model)}")
    page.wait_for_selector("#chat-input", timeout=60_000)
    dismiss_popups(page)
    shot(page, out, f"{slug}-1-empty", result)
    if image:
        attach_image(page, image)
    page.locator("#chat-input").click()
    page.keyboard.type(prompt)
    page.keyboard.press("Enter")
    page.wait_for_url("**/c/**", timeout=60_000)
    result.chat_id = page.url.rstrip("/").rsplit("/", 1)[-1]

    deadline = time.monotonic() + timeout
    settled = None  # once answer and title are in: a little longer for tags and follow-ups (a model may write none)
    while time.monotonic() < deadline:  # the answer, then the background tasks (title, tags, follow-ups)
        chat = (api(page, f"/api/v1/chats/{result.chat_id}") or {}).get("chat", {})
        reply = latest_assistant(chat)
        result.answer = reply.get("content", "") if reply.get("done") else ""
        error = reply.get("error")
        result.error = (error.get("content") if isinstance(error, dict) else str(error)) if error else ""
        result.title = chat.get("title", "")
        result.tags = list(chat.get("tags") or [])
        result.follow_ups = list(reply.get("followUps") or [])
        result.images_sent = sent_images(chat)
        if result.error or (result.tags and result.follow_ups):
            break
        if result.answer and result.title not in ("", DEFAULT_TITLE):
            settled = settled or time.monotonic() + SETTLE_S
            if time.monotonic() > settled:
                break
        time.sleep(1)
    meta = api(page, f"/api/v1/chats/{result.chat_id}/tags")
    if isinstance(meta, list):
        result.tags = [t.get("name", t.get("id", "")) for t in meta]
    page.reload()
    page.wait_for_selector("#chat-input", timeout=60_000)
    time.sleep(2)
    shot(page, out, f"{slug}-2-answered", result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--webui", default="http://127.0.0.1:8080")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="a system Chromium (Playwright's own "
                                                                        "browser download is not needed)")
    parser.add_argument("--chat", action="append", required=True, help="MODEL=PROMPT (repeatable)")
    parser.add_argument("--image", action="append", default=[], help="MODEL=PATH: attach this image to MODEL's chat")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per chat for answer, title and tags")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    images = {model: Path(path) for model, _, path in (spec.partition("=") for spec in args.image)}
    results = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        for spec in args.chat:
            model, _, prompt = spec.partition("=")
            try:
                result = run_chat(page, args.webui, args.out, model, prompt, args.timeout, images.get(model))
                if model in images and not result.images_sent:
                    result.error = result.error or "the image was not stored with the message"
                results.append(result)
            except Exception as exc:  # noqa: BLE001  (reported, the other chats still run)
                failed = ChatResult(model=model, prompt=prompt, error=f"driver: {exc}")
                try:
                    shot(page, args.out, model.replace(":", "_") + "-failed", failed)
                except Exception:  # noqa: BLE001
                    pass
                results.append(failed)
        browser.close()
    for result in results:
        print(json.dumps({"ok": result.ok, "title_generated": result.title_generated, **asdict(result)},
                         ensure_ascii=False))
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2, ensure_ascii=False))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
