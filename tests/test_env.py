"""`dgemma_cli.env`: one table of `DGEMMA_*` variables, read one way, and the docs that list them."""
import re
from pathlib import Path

import pytest

from dgemma_cli import env
from dgemma_cli.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("page", sorted(env.DOCS))
def test_docs_list_the_variables_of_the_table(page):
    variables, marker = env.DOCS[page]
    assert env.docs_block(variables, marker) in (ROOT / page).read_text(encoding="utf-8")


def test_each_variable_is_defined_once():
    names = [var.name for var in env.ALL]
    assert len(names) == len(set(names)) and all(name.startswith("DGEMMA_") for name in names)


def test_every_variable_the_sources_name_is_in_the_table():
    """Any `DGEMMA_*` name in the Python or C sources (code, comments, messages) is a variable of the table."""
    defined = {var.name for var in env.ALL}
    for folder in ("dgemma_cli", "ggml_ext", "convert"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".h"):
                named = set(re.findall(r"DGEMMA_[A-Z0-9_]+(?![A-Z0-9_*])", path.read_text(errors="replace")))
                assert named <= defined, f"{path.relative_to(ROOT)}: {sorted(named - defined)} not in dgemma_cli/env.py"


def test_values_are_cleaned_then_parsed_and_unset_gives_the_default():
    assert env.MAX_QUEUE.get({"DGEMMA_MAX_QUEUE": " '7' "}) == 7
    assert env.MAX_QUEUE.get({}) == 512
    assert env.MAX_STEPS.get_or_default({"DGEMMA_MAX_STEPS": "0"}) == 256
    assert env.PULL_BACKOFF.get_or_default({"DGEMMA_PULL_BACKOFF": "nan"}) == 1.0
    with pytest.raises(ValueError, match="must be at least 1"):
        env.NUM_PARALLEL.get({"DGEMMA_NUM_PARALLEL": "0"})


def test_server_defaults_come_from_the_table():
    config = ServerConfig.from_env({})
    for var in env.SERVER:
        assert getattr(config, var.setting) == var.default and config.sources[var.setting] == "default"
    assert ServerConfig.from_env({"DGEMMA_MAX_QUEUE": "x"}).warnings == [
        "ignoring DGEMMA_MAX_QUEUE='x': invalid literal for int() with base 10: 'x'"]
