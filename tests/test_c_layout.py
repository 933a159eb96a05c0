"""The C engine's file layout (ggml_ext/csrc/engine, docs/engine.md): no include or call cycle between its files, and
a product library that exports the bound API only, with the test hooks in a library of their own.

The sources are read as text: comments and literals stripped, function definitions found at brace depth 0, calls as
`name(` inside a body. A call counts between two files when the name is defined (not `static`, or `static inline` in
a header) in the other one. The export checks read the built libraries with `nm -D` and skip when they are not built.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "ggml_ext" / "csrc"
ENGINE = CSRC / "engine"
HOOKS = CSRC / "engine_tests"
BINDINGS = [ROOT / "ggml_ext" / name for name in ("model.py", "devices.py", "vision.py", "_lib.py")]  # the ctypes bindings of _engine

_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_NAME_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "__attribute__", "_Alignof", "typeof"}


def strip(text: str) -> str:
    """Comments and string / character literals blanked (keeping #include "…" lines intact)."""
    keep = {m.start() for m in _INCLUDE.finditer(text)}

    def blank(m: re.Match) -> str:
        line_start = text.rfind("\n", 0, m.start()) + 1
        if line_start in keep and m.group(0).startswith('"'):
            return m.group(0)
        return " " if m.group(0).startswith("/") else '""'
    return _TOKEN.sub(blank, text)


def without_attributes(head: str) -> str:
    """`__attribute__((…))` groups removed (they precede the name in `__attribute__((target("avx2"))) static …`)."""
    while (at := head.find("__attribute__")) >= 0:
        depth, end = 0, at + len("__attribute__")
        for end in range(end, len(head)):
            depth += {"(": 1, ")": -1}.get(head[end], 0)
            if depth == 0 and head[end] == ")":
                break
        head = head[:at] + head[end + 1:]
    return head


def defined_name(head: str) -> str | None:
    """The function a definition head `… name(params)` names: the identifier before the parameter list that closes
    the head (a macro call before it, such as DEFINE_…(…), is not the name); None for a struct, enum or initializer."""
    head = head.rstrip()
    if not head.endswith(")") or "=" in head:
        return None
    depth = 0
    for i in range(len(head) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            m = re.search(r"([A-Za-z_]\w*)\s*$", head[:i])
            return m.group(1) if m else None
    return None


def top_level(text: str) -> tuple[list[tuple[str, str, str]], str]:
    """(name, head, body) of each function defined at depth 0, and the depth-0 text (declarations, macros)."""
    text = re.sub(r"^\s*#.*?(?<!\\)$", "", text, flags=re.M | re.S)  # preprocessor lines, continuations included
    functions, outer, depth, start, last = [], [], 0, 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
                head = text[last:i]
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                head = without_attributes(head)
                name = defined_name(head)
                if name:
                    functions.append((name, head, text[start:i + 1]))
                else:
                    outer.append(text[last:i + 1])
                last = i + 1
        elif ch == ";" and depth == 0:
            outer.append(text[last:i + 1])
            last = i + 1
    return functions, "".join(outer)


def read_sources(folders: list[Path]) -> dict[str, str]:
    files = {}
    for folder in folders:
        for path in sorted(folder.glob("*.[ch]")):
            files[path.name] = path.read_text(encoding="utf-8")
    return files


def graphs(files: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """File-level include and call graphs."""
    includes = {name: {h for h in _INCLUDE.findall(text) if h in files} for name, text in files.items()}
    defined_in: dict[str, str] = {}
    bodies: dict[str, list[str]] = {}
    for name, text in files.items():
        functions, _ = top_level(strip(text))
        bodies[name] = [body for _, _, body in functions]
        for fn, head, _ in functions:
            is_static = re.search(r"\bstatic\b", head) is not None
            if not is_static or name.endswith(".h"):
                defined_in.setdefault(fn, name)
    calls = {name: set() for name in files}
    for name, file_bodies in bodies.items():
        for body in file_bodies:
            for callee in _NAME_CALL.findall(body):
                where = defined_in.get(callee)
                if callee not in _KEYWORDS and where and where != name:
                    calls[name].add(where)
    return includes, calls


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_parser_sees_the_calls_it_must():
    includes, calls = graphs(read_sources([ENGINE]))
    assert "engine.h" in includes["api.c"]
    assert {"context.c", "decoder.c", "encoder.c", "model.c", "lora.c", "devices.c"} <= calls["api.c"]
    assert "kv_cache.c" in calls["decoder.c"] and "graph.c" in calls["encoder.c"]
    assert calls["cpu.c"] == set()  # the bottom file calls nothing of the engine
    assert "qkernels.h" in calls["qkernels_avx2.c"]  # block helpers defined inline in the header


def test_a_cycle_is_reported():
    assert cycle({"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}) == ["a.c", "b.c", "c.c", "a.c"]
    assert cycle({"a.c": {"b.c"}, "b.c": set()}) is None


@pytest.mark.parametrize("folders", [[ENGINE], [ENGINE, HOOKS]], ids=["engine", "engine+hooks"])
def test_no_include_or_call_cycle(folders):
    includes, calls = graphs(read_sources(folders))
    assert cycle(includes) is None, f"include cycle: {' -> '.join(cycle(includes))}"
    assert cycle(calls) is None, f"call cycle: {' -> '.join(cycle(calls))}"


def test_exported_functions_sit_in_api_c():
    for name, text in read_sources([ENGINE]).items():
        if name in ("api.c", "engine.h"):
            continue
        assert not re.search(r"^\s*DG_API\b", strip(text), re.M), f"{name} exports a function; exports live in api.c"


def test_the_product_sources_hold_no_test_hook():
    for name, text in read_sources([ENGINE]).items():
        assert not re.search(r"\bdg_(bench|check)_\w+\s*\(", strip(text)), f"{name} holds a test hook"


def bound_names() -> set[str]:
    return {n for path in BINDINGS for n in re.findall(r'"(dg_\w+)"', path.read_text(encoding="utf-8"))}


def exports(library: str) -> set[str]:
    if not shutil.which("nm"):
        pytest.skip("nm is not installed")
    spec = importlib.util.find_spec("dgemma_engine")
    folder = Path(next(iter(spec.submodule_search_locations)))
    built = sorted(folder.glob(f"_{library}.*so"))
    if not built:
        pytest.skip(f"_{library} is not built")
    out = subprocess.run(["nm", "-D", "--defined-only", str(built[0])], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def test_the_product_library_exports_the_bound_api_only():
    exported = exports("engine")
    assert exported == bound_names(), (f"exported, not bound: {sorted(exported - bound_names())}; "
                                       f"bound, not exported: {sorted(bound_names() - exported)}")
    assert not {n for n in exported if n.startswith(("dg_bench", "dg_check"))}


def test_the_test_library_exports_the_hooks_only():
    exported = exports("engine_tests")
    assert exported and all(n.startswith(("dg_bench_", "dg_check_")) for n in exported), sorted(exported)
