"""The 14 attacks of issue 36 against one real `dgemma serve` on a loopback port, one table row each.

    python bench/attack_repro.py                 # quick sizes: 3 MB template, 100,000 keys, 1,000 slow clients
    python bench/attack_repro.py --full          # the issue's sizes: 30 MB template, 1,000,000 keys, 5,000 clients
    python bench/attack_repro.py --gguf tiny-a-f32.gguf   # reuse a converted tiny-a fixture

It converts tests/fixtures/tiny-a (unless --gguf), starts `dgemma serve` (tests/server_harness.py ServeProcess) over a
temporary store with the tiny model, a vision model (tiny-a plus the smallest runnable projector, as
tests/fuzz_api.py makes it) and two models whose stored Go templates (1 MB, 100 KB) never went through create's
checks, and a fake registry on loopback (tests/registry_server.py) for the pulls. Then, item by item, it sends the
attack, and prints its HTTP status(es), seconds, the server's RSS after it (and its peak during it), and whether a
normal short `/api/chat` to the tiny model still answers 200 (and in how many seconds). Item 12 runs a second
`dgemma serve` with DGEMMA_READONLY=1 over the same models folder. Item 4 is a small slow-client flood (bench/
slow_clients.py's flood process); the full-size one is `python bench/slow_clients.py --connections 5000` (or
`--full` here). Item 6's bound (schema_compiler.DISK_CACHE_FILES) is not settable, so only the file count is shown.

Exit status 1 when any answer was a 5xx (a registry's refusal of a pull as 502 is the documented answer and is
marked `502*`), the server died, an item's own check failed (a layer left behind, a read-only write, a traceback in
the log, a stored model that cannot run, a flooded chat over 2x its quiet time + 0.1 s), or the server's RSS ended
more than 100 MB above where it started. Nothing leaves the machine: the servers and the registry are on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402

import image_samples  # noqa: E402
from gguf_mutator import KV, PROJECTOR_MUTANTS, U8, mutate, read, write  # noqa: E402
from registry_server import FakeRegistry  # noqa: E402
from server_harness import ServeProcess, free_port  # noqa: E402
from store_helpers import tiny_gguf_bytes, write_tiny_projector  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "tiny-a"
OPTS = {"num_predict": 8, "diffusion_steps": 2, "seed": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": False, "options": OPTS}
RSS_SLACK_MB = 100
FLOOD_SLACK_S = 0.1  # item 4: a flooded chat may take 2x the quiet one plus this
KILL_RSS_MB = 6000  # a safety net on a shared machine: a server past this is killed (and the run fails)
META_MUTANTS = ["tokenizer model missing", "eb_entropy_bound NaN", "eb_max_steps zero", "unknown task"]
PROJ_MUTANTS = ["patch_size zero", "layer_norm_epsilon NaN", "block_count larger than the tensors"]
DOCUMENTED_5XX = {("/api/pull", 502)}  # a registry's refusal, with its reason


def mem(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in MB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) // 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS
    except OSError:
        pass


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def error_of(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
    except ValueError:
        return r.text[:100]
    return str(err.get("message") if isinstance(err, dict) else err or "")


class Attack:
    """The server, its client and what each item found."""

    def __init__(self, server: ServeProcess, models: Path, registry: FakeRegistry, args):
        self.server, self.models, self.registry, self.args = server, models, registry, args
        self.pid = server.process.pid
        self.http = httpx.Client(base_url=server.url, timeout=120)
        self.fresh = httpx.Client(base_url=server.url, timeout=120,
                                  limits=httpx.Limits(max_keepalive_connections=0))  # a new connection per chat
        self.statuses: list[str] = []
        self.notes: list[str] = []
        self.failures: list[str] = []
        self.rows: list[str] = []
        self.killed = False
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        while self.server.process.poll() is None:
            try:
                if mem(self.pid)[0] > KILL_RSS_MB:
                    self.killed = True
                    self.server.process.kill()
                    return
            except (OSError, KeyError):
                return
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.server.process.poll() is None

    # ---- requests ---------------------------------------------------------------------------------------------

    def send(self, method: str, path: str, body=None, expect_4xx: bool = True, **kw) -> httpx.Response | None:
        try:
            r = self.http.request(method, path, json=body, **kw)
        except httpx.HTTPError as exc:
            self.statuses.append(f"EXC:{type(exc).__name__}")
            self.failures.append(f"{method} {path}: {type(exc).__name__}")
            return None
        status = r.status_code
        if status >= 500 and (path, status) in DOCUMENTED_5XX:
            self.statuses.append(f"{status}*")
        else:
            self.statuses.append(str(status))
            if status >= 500:
                self.failures.append(f"{method} {path} -> {status}: {error_of(r)[:120]}")
            elif expect_4xx and status < 400:
                self.failures.append(f"{method} {path} -> {status}, expected a refusal")
        return r

    def chat(self) -> tuple[int | str, float]:
        status, seconds, _ = self.timed_chat()
        return status, seconds

    def timed_chat(self) -> tuple[int | str, float, float]:
        """A normal short chat on a new connection: (status, seconds, the server's own total_duration; the rest was
        spent getting the request in and the answer out)."""
        began = time.perf_counter()
        server_s = float("nan")
        try:
            r = self.fresh.post("/api/chat", json=CHAT)
            status: int | str = r.status_code
            if status == 200:
                server_s = r.json().get("total_duration", 0) / 1e9
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        return status, time.perf_counter() - began, server_s

    def log_text(self) -> str:
        return self.server.logs()

    def note(self, text: str) -> None:
        self.notes.append(text)

    def check(self, ok: bool, text: str) -> None:
        self.notes.append(text if ok else "FAIL " + text)
        if not ok:
            self.failures.append(text)

    # ---- one item ---------------------------------------------------------------------------------------------

    def item(self, number: int, name: str, run) -> None:
        self.statuses, self.notes = [], []
        failures_before = len(self.failures)
        log_before = len(self.log_text())
        reset_peak(self.pid)
        began = time.perf_counter()
        try:
            run(self)
        except Exception as exc:  # the script's own fault, shown as such rather than hidden
            self.check(False, f"script error {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - began
        new_log = self.log_text()[log_before:]
        if "Traceback" in new_log:
            self.check(False, f"{new_log.count('Traceback')} traceback(s) in the log")
        if not self.alive():
            self.failures.append(f"item {number}: the server died (rc {self.server.process.returncode}"
                                 f"{', killed over ' + str(KILL_RSS_MB) + ' MB' if self.killed else ''})")
            rss = peak = "-"
            chat = ("dead", 0.0)
        else:
            rss, peak = mem(self.pid)
            chat = self.chat()
            if chat[0] != 200:
                self.failures.append(f"item {number}: the follow-up chat answered {chat[0]}")
        counts = Counter(self.statuses)
        statuses = " ".join(f"{s}x{n}" if n > 1 else s for s, n in counts.items()) or "-"
        verdict = "ok" if len(self.failures) == failures_before else "FAIL"
        self.rows.append(f"{number:>3}  {name:<24} {statuses:<26} {seconds:7.2f} {rss!s:>7} {peak!s:>7}   "
                         f"{chat[0]!s:>4} {chat[1]:5.2f}  {verdict:<4}  {'; '.join(self.notes)}")
        print(self.rows[-1], flush=True)


# ---- the items ------------------------------------------------------------------------------------------------------

def item1_num_thread(a: Attack) -> None:
    gen = {"model": "tiny", "prompt": "Hi", "stream": False}
    a.send("POST", "/api/create", {"model": "thr", "from": "tiny", "parameters": {"num_thread": 1000},
                                   "stream": False})
    a.send("POST", "/api/generate", {**gen, "options": {**OPTS, "num_thread": 1000}})
    a.send("POST", "/api/pull", {"model": f"{a.registry.host}/library/thr:latest", "insecure": True,
                                 "stream": False})
    modelfile = a.models.parent / "Modelfile.thr"
    modelfile.write_text("FROM tiny\nPARAMETER num_thread 1000\n")
    cli = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "create", "thr-mf", "-f", str(modelfile)],
                         env=a.server.env, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    a.statuses.append(f"cli-rc{cli.returncode}")
    err = cli.stderr.strip().splitlines()
    a.check(cli.returncode != 0 and "Traceback" not in cli.stderr, f"Modelfile: {err[-1][:70] if err else '?'}")
    stored = [name for name in ("thr", "thr-mf", f"{a.registry.host}/library/thr:latest")
              if a.http.post("/api/show", json={"model": name}).status_code != 404]
    a.check(not stored, f"stored: {stored or 'none'}")
    r = a.http.post("/api/create", json={"model": "thr", "from": "tiny", "parameters": {"num_thread": 1000},
                                         "stream": False})
    a.note(error_of(r)[:80])


def item2_go_template(a: Attack) -> None:
    size = int(a.args.template_mb * 1_000_000)
    gen = {"model": "tiny", "prompt": "Hi", "stream": False, "options": OPTS}
    r = a.send("POST", "/api/generate", {**gen, "template": "{{ .Prompt }}" + "x" * size})
    a.note(f"{size / 1e6:g} MB Go template: {error_of(r)[:60]}" if r is not None else "")
    one_letter = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(49)]
    one_letter.append({"role": "user", "content": "a"})
    r = a.send("POST", "/api/chat", {"model": "stored-go-1mb", "stream": False, "options": OPTS,
                                     "messages": one_letter}, expect_4xx=False)
    if r is not None:
        told = error_of(r)[:60] if r.status_code != 200 else f"prompt_eval_count {r.json().get('prompt_eval_count')}"
        a.note(f"stored 1 MB Go template x 50 messages: {r.status_code} {told} (ignored, logged)")
    r = a.send("POST", "/api/chat", {"model": "stored-go-100k", "stream": False, "options": OPTS,
                                     "messages": [{"role": "user", "content": "a"}] * 50})
    if r is not None:
        a.note(f"stored 100 KB one x 50: {error_of(r)[:60]}")


def item3_long_names(a: Attack) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    for host_len in (256, 300, 350):
        long = "h" * host_len + "/ns/m"
        a.send("POST", "/api/show", {"model": long})
        a.send("POST", "/api/generate", {"model": long, "prompt": "Hi", "stream": False})
        a.send("POST", "/api/chat", {"model": long, "messages": msgs, "stream": False})
        a.send("DELETE", "/api/delete", {"model": long})
        a.send("POST", "/api/copy", {"source": long, "destination": "x"})
        a.send("POST", "/api/copy", {"source": "tiny", "destination": long})
        a.send("POST", "/v1/chat/completions", {"model": long, "messages": msgs})
    a.note("3 host lengths (256, 300, 350) x show, generate, chat, delete, copy from/to, /v1/chat/completions")


def item4_slow_clients(a: Attack) -> None:
    quiet = [a.timed_chat() for _ in range(5)]
    quiet_s = statistics.median(s for _, s, _ in quiet)
    log_before = len(a.log_text())
    command = [sys.executable, str(REPO / "bench" / "slow_clients.py"), "--flood-port", str(a.server.port),
               "--connections", str(a.args.connections), "--hold", str(a.args.hold)]
    flood = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(flood.stdout.readline() or "{}").get("started")
        flooded = []
        while flood.poll() is None:
            flooded.append(a.timed_chat())
            time.sleep(0.5)
        report = json.loads(flood.stdout.read() or "{}")
    finally:
        if flood.poll() is None:
            flood.kill()
        flood.wait()
    a.statuses += [str(status) for status, _, _ in flooded]
    ok = [s for status, s, _ in flooded if status == 200]
    median = statistics.median(ok) if ok else float("inf")
    in_server = [(statistics.median(s for status, _, s in chats if status == 200) if chats else float("nan"))
                 for chats in (quiet, flooded)]
    # 2x the quiet time, plus FLOOD_SLACK_S: the tiny model's chat takes tens of milliseconds, where scheduling
    # noise on a shared machine alone doubles it
    a.check(len(ok) == len(flooded) and median <= 2 * quiet_s + FLOOD_SLACK_S,
            f"{started} half-header sockets held {a.args.hold:g} s: chat median {median:.3f} s vs quiet "
            f"{quiet_s:.3f} s, max {max(ok, default=float('inf')):.3f} s ({len(ok)}/{len(flooded)} ok; "
            f"inside the server {in_server[1]:.3f} s vs {in_server[0]:.3f} s)")
    grew = len(a.log_text()) - log_before
    a.check(grew < 100_000, f"log +{grew} bytes")
    if report.get("closed_by_server"):
        a.note(f"server closed {report['closed_by_server']} (after {report['lived_s']['median']} s median)")


def _manifest_digests(models: Path, name: str) -> set[str]:
    path = next((models / "manifests").glob(f"*/*/{name}/latest"))
    m = json.loads(path.read_bytes())
    return {m["config"]["digest"]} | {layer["digest"] for layer in m["layers"]}


def item5_copy_prune(a: Attack) -> None:
    a.send("POST", "/api/create", {"model": "victim", "from": "tiny", "system": "only the victim has this",
                                   "parameters": {"seed": 42}, "stream": False}, expect_4xx=False)
    own = _manifest_digests(a.models, "victim") - _manifest_digests(a.models, "tiny")
    a.send("POST", "/api/copy", {"source": "tiny", "destination": "victim"}, expect_4xx=False)
    left = [d for d in own if (a.models / "blobs" / d.replace(":", "-")).exists()]
    a.check(not left, f"copy over victim: {len(left)} of its {len(own)} own blobs left")


def item6_schema_cache(a: Attack) -> None:
    from dgemma_cli.server.schema_compiler import DISK_CACHE_FILES

    cache = a.models / "cache" / "automata"

    def files() -> tuple[int, int]:
        found = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
        return len(found), sum(p.stat().st_size for p in found)

    before = files()
    for i in range(a.args.schemas):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        a.send("POST", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False, "format": schema,
                                         "options": OPTS}, expect_4xx=False)
    after = files()
    a.check(after[0] <= DISK_CACHE_FILES,
            f"{a.args.schemas} schemas: cache/automata {before[0]} -> {after[0]} files, {after[1] // 1024} KB "
            f"(bound DISK_CACHE_FILES={DISK_CACHE_FILES}, not settable without a code change)")


def item7_many_keys(a: Attack) -> None:
    kvs, tensors = read(a.gguf)
    path = a.models.parent / "many-keys.gguf"
    write(path, kvs + [KV(f"k{i:07d}", U8, 1) for i in range(a.args.keys)], tensors)
    data = path.read_bytes()
    digest = digest_of(data)
    a.http.post(f"/api/blobs/{digest}", content=data).raise_for_status()
    del data
    reset_peak(a.pid)
    began = time.perf_counter()
    r = a.send("POST", "/api/create", {"model": "many-keys", "files": {"m.gguf": digest}, "stream": False},
               expect_4xx=False)
    seconds, peak = time.perf_counter() - began, mem(a.pid)[1]
    refusal = f": {error_of(r)[:100]}" if r is not None and r.status_code != 200 else ""
    a.note(f"{a.args.keys:,} extra keys ({path.stat().st_size / 1e6:.1f} MB): create {seconds:.2f} s, "
           f"peak {peak} MB{refusal}")
    if r is not None and r.status_code == 200:
        a.http.request("DELETE", "/api/delete", json={"model": "many-keys"})


def item8_mutants(a: Attack) -> None:
    image = base64.b64encode(image_samples.png()).decode()
    refused = runs = 0
    for kind, name in [("meta", n) for n in META_MUTANTS] + [("proj", n) for n in PROJ_MUTANTS]:
        if kind == "meta":
            data = mutate(a.gguf, a.models.parent / "mutant.gguf", name).read_bytes()
            files = {"model.gguf": a.upload(data)}
            gen = {"prompt": "Hi"}
        else:
            data = mutate(a.projector, a.models.parent / "mmproj.gguf", name, PROJECTOR_MUTANTS).read_bytes()
            files = {"model.gguf": a.base_digest, "mmproj.gguf": a.upload(data)}
            gen = {"prompt": "what is this?", "images": [image]}
        r = a.send("POST", "/api/create", {"model": "mutant", "files": files, "stream": False}, expect_4xx=False)
        if r is None:
            continue
        if r.status_code != 200:
            refused += 1
            continue
        g = a.send("POST", "/api/generate", {"model": "mutant", "stream": True, "options": OPTS, **gen},
                   expect_4xx=False)
        lines = [json.loads(x) for x in g.text.splitlines() if x.strip()] if g is not None else []
        if g is not None and g.status_code == 200 and lines and lines[-1].get("done") and \
                not any("error" in x for x in lines):
            runs += 1
        else:
            a.check(False, f"{kind} {name!r} stored but cannot run: {g.text[:100] if g is not None else ''}")
        a.http.request("DELETE", "/api/delete", json={"model": "mutant"})
    a.note(f"{len(META_MUTANTS)} metadata + {len(PROJ_MUTANTS)} projector mutants: {refused} refused at create, "
           f"{runs} stored and run")


def item9_pulled_layers(a: Attack) -> None:
    for model in ("wiz", "split", "llama", "rep"):
        r = a.send("POST", "/api/pull", {"model": f"{a.registry.host}/library/{model}:latest", "insecure": True,
                                         "stream": False})
        if r is not None:
            a.note(f"{model}: {error_of(r)[:70]}")
    wiz = f"{a.registry.host}/library/wiz:latest"
    a.send("POST", "/api/show", {"model": wiz})
    a.send("POST", "/api/chat", {"model": wiz, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                                 "options": OPTS})


def item10_big_images(a: Attack) -> None:
    big = base64.b64encode(image_samples.big_white_png()).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + big}}
    r = a.send("POST", "/api/chat", {"model": "vision", "stream": False, "options": {**OPTS, "num_ctx": 1_000_000},
                                     "messages": [{"role": "user", "content": "what are these?",
                                                   "images": [big] * 16}]})
    a.send("POST", "/v1/chat/completions", {"model": "vision", "max_tokens": 16,
                                            "messages": [{"role": "user", "content": [part] * 16}]})
    if r is not None:
        a.check("image" in error_of(r).lower(), f"16 x 5792^2 PNG: {error_of(r)[:200]}")


def item11_deep_template(a: Attack) -> None:
    gen = {"model": "tiny", "prompt": "Hi", "stream": False, "options": OPTS}
    r = a.send("POST", "/api/generate", {**gen, "template": "{{ if .Prompt }}" * 5000 + "{{ .Prompt }}"
                                         + "{{ end }}" * 5000})
    a.send("POST", "/api/generate", {**gen, "template": "{% if messages %}" * 5000 + "x" + "{% endif %}" * 5000})
    if r is not None:
        a.note(f"Go 5000 deep: {error_of(r)[:60]}; Jinja 5000 deep too")


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size if p.is_file() else 0)
            for p in sorted(root.rglob("*"))}


def item12_readonly(a: Attack) -> None:
    before = _snapshot(a.models)
    schema = {"type": "object", "properties": {"readonly": {"type": "integer"}}, "required": ["readonly"]}
    env = {k: v for k, v in a.server_env.items() if k != "DGEMMA_NOPRUNE"}  # its startup must not prune either
    with ServeProcess(a.models, {**env, "DGEMMA_READONLY": "1"}) as ro:
        with httpx.Client(base_url=ro.url, timeout=120) as http:
            main_http, a.http = a.http, http
            try:
                for label, path, body in (
                        ("show sudoku", "/api/show", {"model": "sudoku"}),
                        ("schema", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False,
                                                     "format": schema, "options": {**OPTS, "num_predict": 32}}),
                        ("json", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False, "format": "json",
                                                   "options": OPTS}),
                        ("chat", "/api/chat", CHAT)):
                    r = a.send("POST", path, body, expect_4xx=False)
                    if r is not None:
                        a.note(f"{label} {r.status_code}" + (f" ({error_of(r)[:50]})" if r.status_code != 200 else ""))
                a.send("POST", "/api/copy", {"source": "tiny", "destination": "ro-copy"})
                a.send("DELETE", "/api/delete", {"model": "tiny"})
                a.send("POST", "/api/create", {"model": "ro-new", "from": "tiny", "stream": False})
            finally:
                a.http = main_http
        ro_log = ro.logs()
    after = _snapshot(a.models)
    changed = sorted(set(after) ^ set(before)) + sorted(k for k in set(after) & set(before) if after[k] != before[k])
    a.check(not changed, f"read-only server: {len(changed)} paths of the models folder added/removed/changed"
            + (f" ({', '.join(changed[:3])})" if changed else ""))
    a.check("Traceback" not in ro_log, "read-only server's log has no traceback")


def item13_upload_disconnect(a: Attack) -> None:
    digest = digest_of(b"never sent in full")
    log_before = len(a.log_text())
    for linger in (False, True):  # a plain close, then a reset
        with socket.create_connection(("127.0.0.1", a.server.port), timeout=5) as s:
            s.sendall(f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1:{a.server.port}\r\n"
                      f"Content-Type: application/octet-stream\r\nContent-Length: 20000000\r\n\r\n".encode())
            s.sendall(b"\0" * 2_000_000)
            if linger:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        a.statuses.append("left" + ("-rst" if linger else ""))
    time.sleep(1.5)
    new_log = a.log_text()[log_before:]
    bad = [line for line in new_log.splitlines() if "ERROR" in line or "Traceback" in line]
    a.check(not bad, f"log after 2 uploads left mid-body: {len(bad)} ERROR/Traceback lines"
            + (f" ({bad[0][:60]})" if bad else ""))
    leftovers = [p.name for p in (a.models / "blobs").iterdir() if digest.split(":")[1] in p.name]
    a.check(not leftovers, f"{len(leftovers)} partial files left")
    r = a.http.head(f"/api/blobs/{digest}")
    a.statuses.append(f"HEAD {r.status_code}")


def item14_rest_create(a: Attack) -> None:
    from dgemma_cli.modelfile import parse_modelfile

    for label, body in (("role wizard", {"messages": [{"role": "wizard", "content": "x"}]}),
                        ("requires 1.2.3-aaa... (10,000)", {"requires": "1.2.3-" + "a" * 9994}),
                        ("requires x * 10,000", {"requires": "x" * 10000})):
        r = a.send("POST", "/api/create", {"model": "rest-made", "from": "tiny", "stream": False, **body})
        if r is not None:
            a.note(f"{label}: {error_of(r)[:90]}")
    a.check(a.http.post("/api/show", json={"model": "rest-made"}).status_code == 404, "nothing stored")
    r = a.http.post("/api/show", json={"model": "tiny"})
    try:
        parse_modelfile(r.json()["modelfile"])
        a.note("tiny's show --modelfile parses")
    except Exception as exc:
        a.check(False, f"tiny's show --modelfile does not parse: {exc}")


ITEMS = [
    (1, "num_thread 1000", item1_num_thread),
    (2, "Go template budget", item2_go_template),
    (3, "long names", item3_long_names),
    (4, "slow clients", item4_slow_clients),
    (5, "copy prunes", item5_copy_prune),
    (6, "automata cache bound", item6_schema_cache),
    (7, "metadata-heavy GGUF", item7_many_keys),
    (8, "unrunnable mutants", item8_mutants),
    (9, "pulled layers", item9_pulled_layers),
    (10, "16 big images", item10_big_images),
    (11, "template 5000 deep", item11_deep_template),
    (12, "read-only writes", item12_readonly),
    (13, "upload left mid-body", item13_upload_disconnect),
    (14, "REST create vs Modelfile", item14_rest_create),
]


# ---- setup ----------------------------------------------------------------------------------------------------------

def store_go_model(models: Path, no_template_gguf: Path, name: str, template: str) -> None:
    """A model whose stored Go TEMPLATE never went through create's checks (as one stored before them)."""
    from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_TEMPLATE, Layer, Store, build_manifest,
                                  canonical_json)

    store = Store(models)
    digest, size, _ = store.import_file(no_template_gguf)
    layers = [Layer(MEDIA_MODEL, digest, size), Layer(MEDIA_TEMPLATE, *store.write_blob(template.encode()))]
    config = {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"],
              "template_format": "go"}
    config_digest, config_size = store.write_blob(canonical_json(config))
    store.write_manifest(name, build_manifest(Layer(CONFIG_MEDIA_TYPE, config_digest, config_size), layers))


def hostile_registry(work: Path) -> FakeRegistry:
    from dgemma_cli.store import MEDIA_MESSAGES, MEDIA_MODEL, MEDIA_PARAMS

    registry = FakeRegistry().__enter__()
    small = tiny_gguf_bytes(work)
    registry.add_model("library/thr:latest", [(MEDIA_MODEL, small),
                                              (MEDIA_PARAMS, json.dumps({"num_thread": 1000}).encode())])
    registry.add_model("library/wiz:latest", [(MEDIA_MODEL, small), (MEDIA_MESSAGES,
                                              json.dumps([1, "x", {"role": "wizard"}]).encode())])
    registry.add_model("library/split:latest", [(MEDIA_MODEL, small), (MEDIA_MODEL, small + b"x")])
    registry.add_model("library/llama:latest", [(MEDIA_MODEL, small)], config={"model_family": "llama"})
    raw = json.loads(registry.add_model("library/rep:latest", [(MEDIA_MODEL, small), (MEDIA_PARAMS, b"{}")]))
    raw["layers"].append(dict(raw["layers"][1]))  # one layer digest twice
    registry.set_manifest("library", "rep", "latest", json.dumps(raw).encode())
    return registry


def wait_for_precompile(server: ServeProcess, timeout: float = 90) -> None:
    """Loading a model compiles "any JSON object" in the background: let it finish before RSS is measured."""
    deadline = time.monotonic() + timeout
    while '"any JSON object"' not in server.logs() and 'opens a JSON object' not in server.logs():
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true",
                    help="the issue's sizes (30 MB, 1M keys, 5,000 clients, 100 schemas)")
    ap.add_argument("--template-mb", type=float, help="per-request Go template size (quick 3, full 30)")
    ap.add_argument("--keys", type=int, help="extra one-byte GGUF keys (quick 100,000, full 1,000,000)")
    ap.add_argument("--connections", type=int, help="slow clients (quick 1,000, full 5,000)")
    ap.add_argument("--hold", type=float, help="seconds the slow clients hold (quick 6, full 15)")
    ap.add_argument("--schemas", type=int, help="distinct schemas (quick 30, full 100)")
    ap.add_argument("--gguf", type=Path, help="a converted tiny-a GGUF (f32); else converted here")
    ap.add_argument("--items", type=int, nargs="*", help="only these item numbers")
    ap.add_argument("--keep-log", type=Path, help="copy the server's log here")
    args = ap.parse_args(argv)
    for key, quick, full in (("template_mb", 3.0, 30.0), ("keys", 100_000, 1_000_000),
                             ("connections", 1000, 5000), ("hold", 6.0, 15.0), ("schemas", 30, 100)):
        if getattr(args, key) is None:
            setattr(args, key, full if args.full else quick)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attack36-") as tmp:
        work = Path(tmp)
        models = work / "models"
        if args.gguf:
            gguf = args.gguf.resolve()
        else:
            from dgemma_convert import convert

            gguf = work / "tiny-a-f32.gguf"
            convert(FIXTURE, gguf, "f32", threads=2)
        kvs, tensors = read(gguf)
        no_template = write(work / "tiny-a-no-template.gguf",
                            [kv for kv in kvs if kv.key != "tokenizer.chat_template"], tensors)
        store_go_model(models, no_template, "stored-go-1mb", "{{ .Prompt }}" + "x" * 1_000_000)
        store_go_model(models, no_template, "stored-go-100k", "{{ .Prompt }}" + "x" * 100_000)
        from dgemma_cli.gguf_check import read_gguf_info
        from dgemma_engine.gguf_keys import KEY_EMBEDDING_LENGTH

        n_embd = int(read_gguf_info(gguf).metadata[KEY_EMBEDDING_LENGTH])
        projector = write_tiny_projector(work / "projector.gguf", n_embd_text=n_embd, max_soft_tokens=64)
        registry = hostile_registry(work)
        dead = f"http://127.0.0.1:{free_port()}"  # the default registries go nowhere
        env = {"DGEMMA_NOPRUNE": "1", "DGEMMA_PULL_RETRIES": "0", "DGEMMA_PULL_BACKOFF": "0",
               "DGEMMA_REGISTRY_ALLOW": registry.host,
               "DGEMMA_REGISTRY_MIRRORS": ",".join(f"{h}={dead}" for h in ("registry.ollama.ai", "hf.co",
                                                                            "huggingface.co"))}
        try:
            with ServeProcess(models, env) as server:
                a = Attack(server, models, registry, args)
                a.server_env, a.gguf, a.projector = env, gguf, projector

                def upload(data: bytes) -> str:
                    digest = digest_of(data)
                    a.http.post(f"/api/blobs/{digest}", content=data).raise_for_status()
                    return digest

                a.upload = upload
                a.base_digest = upload(gguf.read_bytes())
                for body in ({"model": "tiny", "files": {"tiny-a.gguf": a.base_digest}, "stream": False},
                             {"model": "vision", "files": {"tiny-a.gguf": a.base_digest,
                                                           "mmproj.gguf": upload(projector.read_bytes())},
                              "stream": False}):
                    a.http.post("/api/create", json=body).raise_for_status()
                image_samples.big_white_png()  # made once, before any item is timed
                for _ in range(2):
                    a.chat()
                wait_for_precompile(server)
                quiet = [a.chat() for _ in range(3)]
                start_rss = mem(a.pid)[0]
                print(f"dgemma serve on {server.url} (pid {a.pid}); quiet chat "
                      f"{statistics.median(s for _, s in quiet):.2f} s; RSS at start {start_rss} MB; sizes: "
                      f"template {args.template_mb:g} MB, {args.keys:,} keys, {args.connections:,} slow clients "
                      f"held {args.hold:g} s, {args.schemas} schemas", flush=True)
                print(f"{'#':>3}  {'item':<24} {'statuses':<26} {'secs':>7} {'RSS MB':>7} {'peak':>7}   "
                      f"{'chat':>4} {'secs':>5}  {'':<4}  notes", flush=True)
                for number, name, run in ITEMS:
                    if args.items and number not in args.items:
                        continue
                    if not a.alive():
                        break
                    a.item(number, name, run)
                end_rss = mem(a.pid)[0] if a.alive() else None
                tracebacks = server.logs().count("Traceback")
            if args.keep_log:
                args.keep_log.write_text(server.logs())
        finally:
            registry.stop()
    print(f"RSS at start {start_rss} MB, at end {end_rss if end_rss is not None else '(server dead)'} MB; "
          f"tracebacks in the server log: {tracebacks}; {time.perf_counter() - began:.0f} s in all")
    if end_rss is None:
        a.failures.append("the server died")
    elif end_rss - start_rss > RSS_SLACK_MB:
        a.failures.append(f"RSS ended {end_rss - start_rss} MB above its start")
    for failure in a.failures:
        print("FAIL:", failure)
    return 1 if a.failures else 0


if __name__ == "__main__":
    sys.exit(main())
