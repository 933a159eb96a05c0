"""Slow-client flood of `dgemma serve` (loopback, bounded): does a normal `/api/chat` still answer in its quiet time?

    python bench/slow_clients.py                          # 5,000 half-header connections, 20 s, tiny-a fixture model
    python bench/slow_clients.py --reopen                 # each socket the server closes is opened again at once
    python bench/slow_clients.py --connections 20000 --server-nofile 20000 --hold 15
    DGEMMA_HEADER_TIMEOUT=2 python bench/slow_clients.py  # the server reads DGEMMA_* from this environment

It converts tests/fixtures/tiny-a, starts `dgemma serve` on a free 127.0.0.1 port over a temporary store (created
through `/api/blobs` + `/api/create`), times `--chats` quiet chats (a new connection each), then opens `--connections`
sockets that each send half a request head and hold for `--hold` seconds (with `--reopen`, sockets the server closes
are replaced, so the flood keeps its size) while a chat is timed every `--chat-every` seconds. It reports the
quiet and flooded chat times, the server's RSS and log size before, during and after, and how the server treated the
idle sockets (closed after how long). Exit status 1 when a flooded chat failed or their median took more than 2x
the quiet one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "tiny-a"
HALF_HEAD = b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appli"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "stream": False,
        "options": {"num_predict": 16, "seed": 1, "diffusion_steps": 4, "num_thread": 1}}
MAX_CONNECTIONS = 30000  # bounded: a loopback test, never a real attack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_own_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Server:
    """`python -m dgemma_cli.main serve` on a free loopback port, its log in a file; `nofile` caps its fd limit."""

    def __init__(self, models_dir: Path, log_path: Path, nofile: int | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {**os.environ, "DGEMMA_HOST": f"127.0.0.1:{self.port}", "DGEMMA_MODELS": str(models_dir),
                    "DGEMMA_NOPRUNE": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.env.pop("DGEMMA_API_KEY", None)
        self.nofile = nofile

    def _limit(self) -> None:
        if self.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def __enter__(self) -> "Server":
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "dgemma_cli.main", "serve"], env=self.env,
                                        stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                        preexec_fn=self._limit)
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=1) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError("dgemma serve exited:\n" + self.log_path.read_text(errors="replace"))
                try:
                    if client.head(self.url + "/").status_code == 200:
                        return self
                except httpx.HTTPError:
                    time.sleep(0.05)
        raise RuntimeError("dgemma serve did not start")

    def log_bytes(self) -> int:
        return self.log_path.stat().st_size

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def prepare_model(url: str, gguf: Path) -> None:
    import hashlib

    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post(f"/api/blobs/{digest}", content=data).raise_for_status()
        r = client.post("/api/create", json={"model": "tiny", "files": {"tiny-a.gguf": digest}, "stream": False})
        r.raise_for_status()


def timed_chat(client: httpx.Client) -> tuple[float, int | str, float]:
    """One chat on a new connection (the client keeps none alive): (seconds, status or the error's name, the
    server's own `total_duration` in seconds: wall time beyond it was spent getting the request in or out)."""
    began = time.perf_counter()
    server_s = float("nan")
    try:
        r = client.post("/api/chat", json=CHAT)
        status: int | str = r.status_code
        if status == 200:
            server_s = r.json().get("total_duration", 0) / 1e9
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return time.perf_counter() - began, status, server_s


class Flood:
    """`size` half-header connections held open; each one the server closes is counted (how long it lived) and,
    with `reopen`, replaced. Runs in its own process (`--flood-port`), so that its event loop does not delay the
    timed chats of the measuring process."""

    def __init__(self, port: int, size: int, reopen: bool):
        self.port, self.size, self.reopen = port, size, reopen
        self.open = 0
        self.opened = 0
        self.connect_failures = 0
        self.closed_by_server: list[float] = []  # seconds each lived
        self.answers: dict[str, int] = {}  # first line of what the server wrote before closing
        self.open_samples: list[int] = []
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()

    async def one(self) -> None:
        while not self.stopping:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 5)
            except (OSError, asyncio.TimeoutError):
                self.connect_failures += 1
                await asyncio.sleep(0.5)
                continue
            self.opened += 1
            self.open += 1
            began = time.perf_counter()
            try:
                writer.write(HALF_HEAD)
                await writer.drain()
                data = await reader.read(256)  # b"" (or an answer) once the server gives up on us
                if not self.stopping:
                    self.closed_by_server.append(time.perf_counter() - began)
                    line = data.split(b"\r\n", 1)[0].decode("latin-1") or "(closed without an answer)"
                    self.answers[line] = self.answers.get(line, 0) + 1
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.transport.abort()
            if not self.reopen:
                return
            await asyncio.sleep(0.01)  # an attacker's reconnect, not a busy loop

    async def run(self, hold: float) -> dict:
        began = time.perf_counter()
        for start in range(0, self.size, 250):  # in batches, so the listen backlog is not the bottleneck
            for _ in range(min(250, self.size - start)):
                self.tasks.add(asyncio.create_task(self.one()))
            await asyncio.sleep(0.05)
        started_s = time.perf_counter() - began
        print(json.dumps({"started": self.open}), flush=True)
        while time.perf_counter() - began < started_s + hold:  # held for `hold` seconds once all were started
            self.open_samples.append(self.open)
            await asyncio.sleep(0.5)
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        lived = self.closed_by_server
        return {"opened": self.opened, "connect_failures": self.connect_failures, "start_s": round(started_s, 2),
                "closed_by_server": len(lived),
                "lived_s": ({"min": round(min(lived), 2), "median": round(statistics.median(lived), 2),
                             "max": round(max(lived), 2)} if lived else None),
                "server_answers": self.answers, "open_min": min(self.open_samples, default=0),
                "open_max": max(self.open_samples, default=0)}


def flood_process(port: int, size: int, hold: float, reopen: bool) -> int:
    raise_own_fd_limit(size + 64)
    print(json.dumps(asyncio.run(Flood(port, size, reopen).run(hold))), flush=True)
    return 0


def summary(seconds: list[float]) -> dict | None:
    if not seconds:
        return None
    return {"median": round(statistics.median(seconds), 3), "max": round(max(seconds), 3), "n": len(seconds)}


def measure(server: Server, args) -> dict:
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return _measure(server, client, args)


def _measure(server: Server, client: httpx.Client, args) -> dict:
    report: dict = {"connections": args.connections, "hold_s": args.hold, "reopen": args.reopen}
    timed_chat(client)  # loads the model
    deadline = time.monotonic() + 120  # then "any JSON object" compiles in the background: let it finish first
    while "compiled" not in server.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.5)
    timed_chat(client)
    quiet = [timed_chat(client) for _ in range(args.chats)]
    report["quiet_chat_s"] = summary([s for s, status, _ in quiet if status == 200])
    report["quiet_chat_server_s"] = summary([s for _, status, s in quiet if status == 200])
    report["rss_mb_before"] = rss_mb(server.process.pid)
    report["log_bytes_before"] = server.log_bytes()
    command = [sys.executable, __file__, "--flood-port", str(server.port), "--connections", str(args.connections),
               "--hold", str(args.hold)] + (["--reopen"] if args.reopen else [])
    flood = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        report["flood_open_at_start"] = json.loads(flood.stdout.readline() or "{}").get("started")
        flooded, rss_peak, fds_peak = [], report["rss_mb_before"], 0
        began = time.perf_counter()
        while flood.poll() is None:
            seconds, status, server_s = timed_chat(client)
            flooded.append((round(seconds, 3), status, round(server_s, 3), round(time.perf_counter() - began, 1)))
            rss_peak = max(rss_peak, rss_mb(server.process.pid))
            fds_peak = max(fds_peak, open_fds(server.process.pid))
            time.sleep(args.chat_every)
        report["flood"] = json.loads(flood.stdout.read() or "{}")
    finally:
        if flood.poll() is None:
            flood.kill()
        flood.wait()
    report["flooded_chats"] = flooded  # (seconds, status, server's total_duration, at second of the flood)
    report["flooded_chat_s"] = summary([s for s, status, _, _ in flooded if status == 200])
    report["flooded_chat_server_s"] = summary([s for _, status, s, _ in flooded if status == 200])
    report["flooded_failures"] = sum(1 for _, status, _, _ in flooded if status != 200)
    # wall time beyond the server's own: getting the request in and the answer out, what slow clients could delay
    report["quiet_http_overhead_s"] = summary([w - s for w, status, s in quiet if status == 200])
    report["flooded_http_overhead_s"] = summary([w - s for w, status, s, _ in flooded if status == 200])
    report["rss_mb_peak"] = rss_peak
    report["server_fds_peak"] = fds_peak
    report["log_bytes_during"] = server.log_bytes()
    time.sleep(2)
    after = [timed_chat(client) for _ in range(args.chats)]
    report["after_chat_s"] = summary([s for s, status, _ in after if status == 200])
    report["rss_mb_after"] = rss_mb(server.process.pid)
    report["log_bytes_after"] = server.log_bytes()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=5000)
    ap.add_argument("--hold", type=float, default=20.0, help="seconds the flood is held")
    ap.add_argument("--chats", type=int, default=5, help="quiet chats timed before (and after) the flood")
    ap.add_argument("--chat-every", type=float, default=1.0)
    ap.add_argument("--reopen", action="store_true", help="replace each socket the server closes")
    ap.add_argument("--server-nofile", type=int, help="the server's RLIMIT_NOFILE (soft and hard)")
    ap.add_argument("--gguf", type=Path, help="a converted tiny-a GGUF (else converted here)")
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--keep-log", type=Path, help="copy the server's log here")
    ap.add_argument("--flood-port", type=int, help=argparse.SUPPRESS)  # the flood's own process
    args = ap.parse_args(argv)
    if not 1 <= args.connections <= MAX_CONNECTIONS or not 0 < args.hold <= 300:
        ap.error(f"--connections must be 1..{MAX_CONNECTIONS} and --hold at most 300 s (a bounded loopback test)")
    if args.flood_port:
        return flood_process(args.flood_port, args.connections, args.hold, args.reopen)
    if raise_own_fd_limit(args.connections + 64) < args.connections + 32:
        ap.error(f"this user may open only {resource.getrlimit(resource.RLIMIT_NOFILE)[1]} files; lower --connections")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = args.gguf
        if gguf is None:
            from dgemma_convert import convert

            gguf = work / "tiny-a.gguf"
            convert(FIXTURE, gguf, "f32", threads=2)
        with Server(work / "models", work / "serve.log", args.server_nofile) as server:
            prepare_model(server.url, gguf)
            report = measure(server, args)
        if args.keep_log:
            args.keep_log.write_bytes((work / "serve.log").read_bytes())
    quiet = report["quiet_chat_s"]["median"]
    flooded = report["flooded_chat_s"]
    report["flooded_over_quiet_median"] = round(flooded["median"] / quiet, 2) if flooded else None
    report["within_2x_quiet"] = bool(flooded) and report["flooded_failures"] == 0 and flooded["median"] <= 2 * quiet
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if report["within_2x_quiet"] else 1


if __name__ == "__main__":
    sys.exit(main())
