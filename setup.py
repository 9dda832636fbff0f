"""Package layout only (the metadata is in pyproject.toml): the library from src/, and the repository's
pipelines/ and components/ folders installed as `ctrflow_pipelines` and `ctrflow_components` (left out
where a build copies only src/, as the serving image does)."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
FOLDERS = {"ctrflow_pipelines": "pipelines", "ctrflow_components": "components"}
FOLDERS = {name: folder for name, folder in FOLDERS.items() if (HERE / folder / "__init__.py").exists()}

packages = find_packages(str(HERE / "src"))
for name, folder in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]

setup(package_dir={"": "src", **FOLDERS}, packages=packages)
