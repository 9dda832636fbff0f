"""The layout says it: only Criteo's own modules (its description `contract/criteo.py`, its fast paths
`ingest/criteo/`, its generators `synth/criteo.py` and `synth/dlrmv2.py`, MLPerf's multi-hot Criteo)
name Criteo's columns; everything else reads the
feature contract from schema.json."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ctrflow"
CRITEO = (SRC / "contract" / "criteo.py", SRC / "ingest" / "criteo", SRC / "synth" / "criteo.py",
          SRC / "synth" / "dlrmv2.py")
CRITEO_MODULES = ("ctrflow.contract.criteo", "ctrflow.ingest.criteo", "ctrflow.synth.criteo", "ctrflow.synth.dlrmv2")
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
            names = {alias.name for alias in node.names}
            if module in ("ctrflow.contract", "ctrflow.synth") and "criteo" in names:
                found.append(f"{node.lineno}: from {module} import {', '.join(sorted(names))}")
                continue
            if not module.startswith(CRITEO_MODULES):
                continue
            if names & CONSTANTS or "*" in names:
                found.append(f"{node.lineno}: from {module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(CRITEO_MODULES):
                    found.append(f"{node.lineno}: import {alias.name}")
    return found


def test_only_the_criteo_package_imports_criteo_columns():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if any(path == own or own in path.parents for own in CRITEO):
            continue
        package = ".".join(path.relative_to(SRC.parent).parts[:-1])
        imports = criteo_column_imports(path.read_text(encoding="utf-8"), package)
        if imports:
            offenders[str(path.relative_to(SRC))] = imports
    assert not offenders, "modules other than Criteo's own import Criteo's columns: " + "; ".join(
        f"{name} ({', '.join(lines)})" for name, lines in offenders.items())


def test_the_check_finds_every_spelling_of_the_import():
    flagged = ["from ctrflow.contract.criteo import DENSE",
               "from ctrflow.ingest.criteo.parsing import TEST_COLUMNS",
               "from .criteo import SPARSE, criteo_features",
               "from ctrflow.contract import criteo",
               "import ctrflow.contract.criteo"]
    for text in flagged:
        assert criteo_column_imports(text, "ctrflow.contract"), text
    clean = ["from ctrflow.contract.criteo import criteo_features",
             "from ctrflow.contract.features import LABEL", "from .description import Description"]
    for text in clean:
        assert not criteo_column_imports(text, "ctrflow.contract"), text
