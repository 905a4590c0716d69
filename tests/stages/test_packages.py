"""The packages depend one way: engine -> policies -> model; the model never imports the policies
(nor anything the engine), so fitting and predicting stand alone."""

from __future__ import annotations

import ast
from pathlib import Path

import bdsgd.stages

ORDER = ("engine", "policies", "model")  # a package may import only those after it


def imported_packages(package: str) -> set[str]:
    root = Path(bdsgd.stages.__file__).parent / package
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stages."):
                found.add(node.module.split(".")[1])
    return found & set(ORDER)


def test_no_package_imports_one_before_it():
    for i, package in enumerate(ORDER):
        assert not imported_packages(package) & set(ORDER[:i]), package
