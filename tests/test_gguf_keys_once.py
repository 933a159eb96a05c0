"""Each GGUF name is spelled once in product Python: the architecture in `dgemma_engine.arch`, the metadata keys in
`dgemma_engine.gguf_keys`, the sampler keys in `dgemma_engine.settings` and the task key in `dgemma_engine.tasks`;
every other module imports them.

Product modules are read with `ast`: a string literal equal to a name, or an f-string that builds one from its
namespace ("tokenizer.ggml.{x}") or its architecture suffix ("{arch}.context_length"), outside the name's home fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

from dgemma_engine import arch, gguf_keys, settings, tasks

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("ggml_ext", "convert", "dgemma_cli", "modelfiles")


def names_and_homes() -> dict[str, str]:
    """Each name -> the one file (relative to the repository) that spells it."""
    homes: dict[str, str] = {}

    def add(names, where: str) -> None:
        for name in names:
            assert name not in homes, f"{name} is defined in {homes[name]} and in {where}"
            homes[name] = where
    add([arch.ARCH], "ggml_ext/arch.py")
    add([tasks.TASK_KEY], "ggml_ext/tasks.py")
    add([s.gguf_key for s in settings.FILE_SETTINGS], "ggml_ext/settings.py")
    add([value for name, value in vars(gguf_keys).items() if name.startswith("KEY_")], "ggml_ext/gguf_keys.py")
    return homes


HOMES = names_and_homes()
NAMESPACES = ("general.", "tokenizer.ggml.", "tokenizer.", "diffusion.", "adapter.", "adapter.lora.",
              arch.ARCH + ".")
ARCH_SUFFIXES = {key.removeprefix(arch.ARCH) for key in HOMES if key.startswith(arch.ARCH + ".")}

def spelled_names(path: Path) -> set[str]:
    """The GGUF names (or name-building f-string pieces) a source file spells."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in HOMES:
            found.add(node.value)
        elif isinstance(node, ast.JoinedStr):
            for before, part, after in zip([None, *node.values], node.values, [*node.values[1:], None]):
                if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                    continue
                if isinstance(after, ast.FormattedValue) and part.value in NAMESPACES:
                    found.add(part.value)  # f"tokenizer.ggml.{key}"
                if isinstance(before, ast.FormattedValue) and part.value in ARCH_SUFFIXES:
                    found.add(part.value)  # f"{arch}.context_length"
    return found


def product_files() -> list[Path]:
    return sorted(path for folder in PRODUCT for path in (ROOT / folder).rglob("*.py"))


def test_the_homes_hold_every_name():
    assert arch.ARCH == "diffusion-gemma"
    assert HOMES[gguf_keys.KEY_CHAT_TEMPLATE] == "ggml_ext/gguf_keys.py"
    assert gguf_keys.KEY_BLOCK_COUNT == "diffusion-gemma.block_count"
    assert gguf_keys.for_arch(gguf_keys.KEY_CONTEXT_LENGTH, "llama") == "llama.context_length"


def test_each_name_is_spelled_in_its_home():
    """(The architecture keys are built there from ARCH and their suffix.)"""
    for name, where in HOMES.items():
        spelled = [n for n in spelled_names(ROOT / where) if n == name]
        assert spelled or name.startswith(arch.ARCH + "."), f"{name} is not spelled in {where}"


def test_no_product_module_spells_a_gguf_name_outside_its_home():
    offences = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        extra = {n for n in spelled_names(path) if HOMES.get(n) != rel}
        offences += [f"{rel}: {n!r}" for n in sorted(extra)]
    assert not offences, "import these from their home (dgemma_engine.arch / gguf_keys / settings / tasks):\n" + \
        "\n".join(offences)


def test_the_check_sees_what_it_looks_for(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('a = "tokenizer.chat_template"\nb = f"{x}.context_length"\nc = f"tokenizer.ggml.{k}"\n'
                      'd = "diffusion-gemma"\ne = f"the tokenizer.chat_template is {t}"\n')
    assert spelled_names(source) == {"tokenizer.chat_template", ".context_length", "tokenizer.ggml.",
                                     "diffusion-gemma"}
