"""The Origin allow-list matches parsed origins (issue 14): a `*` in a pattern can never reach a foreign host
through user info, a path or a non-numeric port."""
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.security import OriginPolicy


@pytest.fixture(scope="module")
def policy():
    return OriginPolicy(ServerConfig.from_env({"DGEMMA_ORIGINS": "https://*.example.org"}))


@pytest.mark.parametrize("origin", ["http://localhost", "http://localhost:11434", "https://127.0.0.1:8080",
                                    "http://[::1]:3000", "app://abc", "vscode-webview://x1y2", "tauri://localhost",
                                    "https://chat.example.org", "HTTP://LOCALHOST:5173"])
def test_local_and_configured_origins_are_allowed(policy, origin):
    assert policy.allows(origin)


@pytest.mark.parametrize("origin", ["http://localhost:@evil.example", "http://localhost:80@evil.example",
                                    "http://localhost:80.evil.example", "http://localhost:1/evil",
                                    "http://localhost:x", "http://localhost:99999", "http://localhost.evil.example",
                                    "https://evil.example/.example.org", "https://a@b.example.org",
                                    "https://evil.example?.example.org", "https://evil.example#.example.org",
                                    "http://evil.example", "null", ""])
def test_look_alikes_are_refused(policy, origin):
    assert not policy.allows(origin)
