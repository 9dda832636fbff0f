"""Imports point one way: pipelines → components → ctrflow, and inside ctrflow data code knows nothing of
models, models nothing of training, sharding, devices or datasets, inference nothing of training.

Read from every module's import statements (the syntax tree, so imports inside functions count too);
imports under `if TYPE_CHECKING:` are annotations only, never executed, and are not counted. One test
imports the inference modules for real and checks that training code stayed out of the process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the repository folder -> the package name it installs as
PACKAGES = {REPO / "src" / "ctrflow": "ctrflow", REPO / "pipelines": "ctrflow_pipelines",
            REPO / "components": "ctrflow_components"}
KFP_CODE = ("pipelines", "components", "ctrflow_pipelines", "ctrflow_components")
INFERENCE = ("ctrflow.serve", "ctrflow.predict", "ctrflow.registry", "ctrflow.promotion", "ctrflow.lineage",
             "ctrflow.export", "ctrflow.evaluate",
             "ctrflow.checkpoint")
SHARDING = ("ctrflow.embedding.sharded", "ctrflow.embedding.comm", "ctrflow.embedding.plan",
            "ctrflow.accel.parallelize")
DEVICES = ("torch.distributed", "torch.cuda", "triton")
# what names a dataset: its description, generator and ingestion (the feature contract itself names none)
DATASETS = ("ctrflow.contract.catalog", "ctrflow.contract.criteo", "ctrflow.contract.movielens",
            "ctrflow.contract.description", "ctrflow.ingest", "ctrflow.synth")
DATA = ("ctrflow.contract", "ctrflow.ingest", "ctrflow.synth")


@dataclass(frozen=True)
class Import:
    """One imported name as written in a module."""

    module: str  # the importing module, e.g. ctrflow.serve.ranking
    name: str  # what it imports, absolute, e.g. ctrflow.train.optim
    where: str  # file:line

    def within(self, prefixes: tuple[str, ...]) -> bool:
        """Whether the imported name is one of `prefixes` or inside one of them."""
        return any(self.name == p or self.name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    """The dotted name a repository file installs as."""
    for folder, package in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((package, *parts)).removesuffix(".__init__")
    raise ValueError(path)


def called(node: ast.AST) -> str | None:
    """The last part of a plain or dotted name (`typing.TYPE_CHECKING` -> TYPE_CHECKING)."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def executed_nodes(node: ast.AST):
    """The nodes under `node`, leaving out the bodies of `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and called(child.test) == "TYPE_CHECKING":
            for stmt in child.orelse:
                yield stmt
                yield from executed_nodes(stmt)
            continue
        yield child
        yield from executed_nodes(child)


def imports_of(path: Path) -> list[Import]:
    """Every name `path` imports: import statements and `importlib.import_module("...")` calls."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in executed_nodes(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` steps up
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and called(node.func) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        found += [Import(module, name, f"{path.relative_to(REPO)}:{node.lineno}") for name in names]
    return found


def all_imports() -> list[Import]:
    """The imports of every module in src/ctrflow, pipelines/ and components/."""
    return [imp for folder in PACKAGES for path in sorted(folder.rglob("*.py")) for imp in imports_of(path)]


IMPORTS = all_imports()


def offenders(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """`file:line imports NAME` for each import of `forbidden` by a module within `importers`."""
    return sorted({f"{imp.where} imports {imp.name}" for imp in IMPORTS
                   if Import("", imp.module, "").within(importers) and imp.within(forbidden)})


def test_the_rules_see_every_package():
    modules = {imp.module for imp in IMPORTS}
    for package in ("ctrflow.models.dlrm", "ctrflow.serve.ranking", "ctrflow_pipelines.pipeline",
                    "ctrflow_components.train", "ctrflow.ingest.run", "ctrflow.synth.criteo"):
        assert package in modules


def test_library_never_imports_the_pipeline_or_components():
    assert offenders(("ctrflow",), KFP_CODE) == []


def test_components_never_import_the_pipeline():
    assert offenders(("ctrflow_components",), ("pipelines", "ctrflow_pipelines")) == []


def test_inference_code_never_imports_training():
    assert offenders(INFERENCE, ("ctrflow.train",)) == []


def test_models_know_nothing_of_training_sharding_devices_or_datasets():
    assert offenders(("ctrflow.models",), ("ctrflow.train", "ctrflow.accel", *DATASETS, "ctrflow.loaders",
                                           *SHARDING, *DEVICES)) == []


def test_data_code_never_imports_models_or_training():
    assert offenders(DATA, ("ctrflow.models", "ctrflow.train")) == []


def test_the_feature_contract_imports_no_ingestion_or_generator():
    assert offenders(("ctrflow.contract",), ("ctrflow.ingest", "ctrflow.synth")) == []


def test_serving_predict_and_the_registry_read_raw_rows_through_the_contract_only():
    readers = ("ctrflow.serve", "ctrflow.predict", "ctrflow.registry")
    assert offenders(readers, ("ctrflow.ingest", "ctrflow.synth")) == []


def test_loading_inference_modules_loads_no_training_code():
    # what the statements above cannot see: a module they import that imports training in turn
    modules = [m for m in sorted({imp.module for imp in IMPORTS}) if Import("", m, "").within(INFERENCE)
               and not m.startswith("ctrflow.serve.models")]  # Triton's python-backend files, run by Triton
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.startswith('ctrflow.train')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_tests_share_code_through_fixtures_not_sys_path():
    edits = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path."):
                edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name.split(".")[-1].startswith("test_") for name in names):  # another test module
                edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert edits == []
