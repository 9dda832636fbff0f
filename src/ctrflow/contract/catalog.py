"""The built-in datasets and the description a `--dataset` value names: the built-in Criteo TSV
(`ctrflow.contract.criteo`), or a table described by a file (`ctrflow.contract.description`)."""

from __future__ import annotations

import os

from ctrflow.contract.criteo import criteo_description
from ctrflow.contract.description import Description, load_description

BUILT_IN = ("criteo",)


def describe(spec: str | os.PathLike | Description | None = "criteo") -> Description:
    """The description a `--dataset` value names ("criteo", a YAML/JSON file, or a Description)."""
    if isinstance(spec, Description):
        return spec
    if spec is None or str(spec) == "criteo":
        return criteo_description()
    return load_description(spec)
