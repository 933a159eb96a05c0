"""The import graph of dgemma's three packages: no cycles (between modules and between the packages themselves), no
borrowed private names, client code apart from the server.

Imports are read with `ast` from the source files (module level, inside functions and under `TYPE_CHECKING` alike: a
lazy import is still a dependency), so the test needs neither the C engine nor the optional dependencies. The layering
rule it checks is the one docs/architecture.md states.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"dgemma_cli": ROOT / "dgemma_cli", "dgemma_engine": ROOT / "ggml_ext", "dgemma_convert": ROOT / "convert"}

# Client-side modules: what a CLI command uses to talk to a server. They never reach dgemma_cli.server, not even
# through another module (`local_server` is the one bridge that starts the app in-process).
CLIENT_SIDE = ("dgemma_cli.client", "dgemma_cli.store_client", "dgemma_cli.render", "dgemma_cli.live_view",
               "dgemma_cli.ui", "dgemma_cli.session", "dgemma_cli.prompt_images", "dgemma_cli.names", "dgemma_cli.env",
               "dgemma_cli.gotext", "dgemma_cli.hosts")
SERVER_PACKAGE = "dgemma_cli.server"

# The packages bottom up: the engine, the converter (which uses the engine's names, settings and errors), the CLI. A
# package imports only from the ones before it.
PACKAGE_ORDER = ("dgemma_engine", "dgemma_convert", "dgemma_cli")

# dgemma_cli's layers, top to bottom (docs/architecture.md): a module imports from its own layer or the ones below.
LAYERS = (
    ("commands", ("main", "cmd_run", "repl", "sudoku", "cmd_store", "cmd_serve", "cmd_convert", "cmd_debug")),
    ("shared CLI", ("session", "ui", "render", "live_view", "prompt_images")),
    ("client", ("local_server", "client", "store_client")),
    ("server", ("server",)),
    ("store", ("create", "registry", "store", "modelfile", "gguf_check", "bundled", "projector")),
    ("neutral", ("wire", "env", "hosts", "gotext", "names", "errors")),
)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: set[str] = field(default_factory=set)  # modules of the three packages this one imports
    private_uses: list[str] = field(default_factory=list)  # `line: what` for each borrowed private name

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def discover() -> dict[str, Module]:
    modules = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([top, *parts])
            modules[name] = Module(name, path, is_package)
    return modules


def absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def owner(dotted: str, modules: dict[str, Module]) -> str | None:
    """The longest known module that `dotted` names or lies inside."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def may_use_private(importer: Module, holder: str, modules: dict[str, Module]) -> bool:
    """A private name (or private submodule) of `holder` is for `holder` itself; a package's private parts are also
    for the modules inside it (`dgemma_engine._lib`, `dgemma_engine._engine`); a package `__init__` may re-export
    what its own submodules define."""
    if importer.name == holder:
        return True
    if modules[holder].is_package and importer.name.startswith(holder + "."):
        return True
    return importer.is_package and holder.startswith(importer.name + ".")


def private_member(dotted: str, modules: dict[str, Module]) -> tuple[str, str] | None:
    """(module, private part) when `dotted` reaches a private name or private submodule through a module."""
    parts = dotted.split(".")
    for end in range(1, len(parts)):
        head = ".".join(parts[:end])
        if head in modules and is_private(parts[end]):
            return head, parts[end]
    return None


def analyse(module: Module, modules: dict[str, Module]) -> None:
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    aliases: dict[str, str] = {}  # local name -> module it binds

    def note_private(line: int, dotted: str) -> None:
        found = private_member(dotted, modules)
        if found is not None and not may_use_private(module, found[0], modules):
            shown = module.path.relative_to(ROOT) if module.path.is_relative_to(ROOT) else module.path
            module.private_uses.append(f"{shown}:{line}: {dotted}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = owner(alias.name, modules)
                if target is None:
                    continue
                module.imports.add(target)
                note_private(node.lineno, alias.name)
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node)
            if owner(source, modules) is None:
                continue
            for alias in node.names:
                dotted = f"{source}.{alias.name}"
                target = dotted if dotted in modules else owner(source, modules)
                module.imports.add(target)
                note_private(node.lineno, dotted)
                if dotted in modules:
                    aliases[alias.asname or alias.name] = dotted
    for node in ast.walk(tree):  # `client._http_client`, `dgemma_cli.client._check` through a bound module
        if isinstance(node, ast.Attribute):
            chain = []
            inner: ast.AST = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                note_private(node.lineno, ".".join([aliases[inner.id], *reversed(chain)]))
    module.imports.discard(module.name)


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    modules = discover()
    for module in modules.values():
        analyse(module, modules)
    return modules


def find_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, iter(sorted(modules[start].imports)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            name, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(modules[target].imports))))
                    advanced = True
                    break
                if target in on_stack:
                    low[name] = min(low[name], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[name])
            if low[name] == index[name]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == name:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def reachable(start: str, modules: dict[str, Module]) -> dict[str, str]:
    """Every module `start` reaches, each with the module it was first reached from (to print the path)."""
    seen = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        for target in sorted(modules[name].imports):
            if target not in seen:
                seen[target] = name
                todo.append(target)
    return seen


def path_to(target: str, parents: dict[str, str]) -> str:
    chain = [target]
    while parents[chain[-1]]:
        chain.append(parents[chain[-1]])
    return " -> ".join(reversed(chain))


def test_every_package_is_read(graph):
    for top in PACKAGES:
        assert top in graph and any(name.startswith(top + ".") for name in graph)


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def package_edges(modules: dict[str, Module]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, module in sorted(modules.items()):
        for target in sorted(module.imports):
            here, there = name.split(".")[0], target.split(".")[0]
            if here != there:
                edges.setdefault((here, there), []).append(f"{name} -> {target}")
    return edges


def package_cycles(edges) -> list[list[str]]:
    """The import cycles between packages."""
    packages: dict[str, Module] = {}
    for here, there in edges:
        packages.setdefault(here, Module(here, Path(here), True)).imports.add(there)
        packages.setdefault(there, Module(there, Path(there), True))
    return find_cycles(packages)


def test_no_import_cycles_between_packages(graph):
    cycles = package_cycles(package_edges(graph))
    assert not cycles, "import cycles between packages:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_packages_import_only_the_ones_below(graph):
    upward = [i for (here, there), imports in package_edges(graph).items()
              if PACKAGE_ORDER.index(there) > PACKAGE_ORDER.index(here)
              for i in imports]
    assert not upward, "imports from a package above (engine < convert < cli):\n" + "\n".join(upward)


def test_no_private_names_of_other_modules(graph):
    uses = [use for module in graph.values() for use in module.private_uses]
    assert not uses, "private names used outside their module:\n" + "\n".join(uses)


@pytest.mark.parametrize("name", CLIENT_SIDE)
def test_client_side_never_reaches_the_server(graph, name):
    assert name in graph, f"{name} is listed as client side but does not exist"
    parents = reachable(name, graph)
    server = sorted(m for m in parents if m == SERVER_PACKAGE or m.startswith(SERVER_PACKAGE + "."))
    assert not server, "client code reaches server code: " + path_to(server[0], parents)


def layer_of(name: str) -> int | None:
    """The index in LAYERS of a dgemma_cli module (`dgemma_cli.server.*` all in `server`); None for the package."""
    parts = name.split(".")
    if parts[0] != "dgemma_cli" or len(parts) == 1:
        return None
    return next((i for i, (_, members) in enumerate(LAYERS) if parts[1] in members), -1)


def test_every_cli_module_has_a_layer(graph):
    unplaced = sorted(name for name in graph if layer_of(name) == -1)
    assert not unplaced, f"add these to LAYERS (and to docs/architecture.md): {unplaced}"


def test_no_module_imports_a_higher_layer(graph):
    upward = []
    for name, module in sorted(graph.items()):
        here = layer_of(name)
        for target in sorted(module.imports):
            there = layer_of(target)
            if here is not None and there is not None and 0 <= there < here:
                upward.append(f"{name} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_checks_see_what_they_look_for(tmp_path):
    """The analysis itself, on a made-up package: a cycle through a function-level import, `from x import _name`,
    `module._name` through a bound module, and a private submodule used from outside its package."""
    sources = {
        "a": "import p.b\n\ndef f():\n    return p.b._hidden\n",
        "b": "def g():\n    from p.a import _helper\n    return _helper\n",
        "c": "from q import _inner\n",
    }
    modules = {}
    for short, text in sources.items():
        path = tmp_path / f"{short}.py"
        path.write_text(text)
        modules[f"p.{short}"] = Module(f"p.{short}", path, False)
    (tmp_path / "q").mkdir()
    modules["q"] = Module("q", tmp_path / "q" / "__init__.py", True)
    modules["q._inner"] = Module("q._inner", tmp_path / "q" / "_inner.py", False)
    for path in (modules["q"].path, modules["q._inner"].path):
        path.write_text("")
    for module in modules.values():
        analyse(module, modules)
    assert modules["p.b"].imports == {"p.a"} and find_cycles(modules) == [["p.a", "p.b"]]
    assert [use.split(": ")[-1] for use in modules["p.a"].private_uses] == ["p.b._hidden"]
    assert [use.split(": ")[-1] for use in modules["p.b"].private_uses] == ["p.a._helper"]
    assert [use.split(": ")[-1] for use in modules["p.c"].private_uses] == ["q._inner"]
    assert private_member("p.b.__version__", modules) is None
    edges = package_edges(modules)
    assert edges == {("p", "q"): ["p.c -> q._inner"]} and package_cycles(edges) == []
    modules["q._inner"].path.write_text("import p.a\n")
    analyse(modules["q._inner"], modules)
    assert package_cycles(package_edges(modules)) == [["p", "q"]]
