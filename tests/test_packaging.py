"""A non-editable install ships every Python package: pyproject's explicit package list must cover each folder.

(An omitted sub-package works in the editable checkout CI uses but breaks `pip install .`, the README quickstart.)
"""
from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_folder_with_python_code_is_a_listed_package():
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    for import_name, folder in setuptools_cfg["package-dir"].items():
        root = REPO / folder
        for source in root.rglob("*.py"):
            relative = source.parent.relative_to(root)
            if "__pycache__" in relative.parts:
                continue
            dotted = ".".join((import_name, *relative.parts))
            assert dotted in listed, f"{source.relative_to(REPO)} is in package {dotted}, missing from pyproject"


def test_bundled_model_and_presets_are_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["dgemma_modelfiles"]
    assert "*.gguf" in patterns and "*.Modelfile" in patterns
    assert (REPO / "modelfiles" / "sudoku.gguf").is_file()
