"""The layout says it: only the Criteo dataset package (`ctrflow/datasets/criteo/`) names Criteo's columns;
everything else reads the feature contract from schema.json."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ctrflow"
CRITEO = SRC / "datasets" / "criteo"
CONSTANTS = {"DENSE", "SPARSE", "RAW_COLUMNS", "TEST_COLUMNS"}


def criteo_column_imports(text: str, package: str) -> list[str]:
    """`line: import` of every import of Criteo's column constants (or of the module holding them) in a
    module of `package` (for relative imports)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if not module.startswith("ctrflow.datasets.criteo"):
                continue
            names = {alias.name for alias in node.names}
            if names & CONSTANTS or (module == "ctrflow.datasets.criteo" and "columns" in names) or "*" in names:
                found.append(f"{node.lineno}: from {module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ctrflow.datasets.criteo.columns":
                    found.append(f"{node.lineno}: import {alias.name}")
    return found


def test_only_the_criteo_package_imports_criteo_columns():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if CRITEO in path.parents:
            continue
        package = ".".join(path.relative_to(SRC.parent).parts[:-1])
        imports = criteo_column_imports(path.read_text(encoding="utf-8"), package)
        if imports:
            offenders[str(path.relative_to(SRC))] = imports
    assert not offenders, "modules outside datasets/criteo/ import Criteo's columns: " + "; ".join(
        f"{name} ({', '.join(lines)})" for name, lines in offenders.items())


def test_the_check_finds_every_spelling_of_the_import():
    flagged = ["from ctrflow.datasets.criteo.columns import DENSE",
               "from ctrflow.datasets.criteo.parsing import TEST_COLUMNS",
               "from .criteo.columns import SPARSE, criteo_features",
               "from ctrflow.datasets.criteo import columns",
               "import ctrflow.datasets.criteo.columns"]
    for text in flagged:
        assert criteo_column_imports(text, "ctrflow.datasets"), text
    clean = ["from ctrflow.datasets.criteo.columns import criteo_features",
             "from ctrflow.features import LABEL", "from .description import Description"]
    for text in clean:
        assert not criteo_column_imports(text, "ctrflow.datasets"), text
