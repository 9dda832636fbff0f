"""The built-in datasets and the description a `--dataset` value names: the built-in Criteo TSV
(`ctrflow.contract.criteo`), or a table described by a file (`ctrflow.contract.description`)."""

from __future__ import annotations

import os

from ctrflow.contract.criteo import criteo_description
from ctrflow.contract.description import Description, load_description

# name -> its description; a name here is a `--dataset` value (one without fast paths of its own in
# `ctrflow.ingest` runs on the described-table engine)
BUILT_IN = {"criteo": criteo_description}


def describe(spec: str | os.PathLike | Description | None = "criteo") -> Description:
    """The description a `--dataset` value names (a built-in name, a YAML/JSON file, or a Description)."""
    if isinstance(spec, Description):
        return spec
    name = "criteo" if spec is None else str(spec)
    if name in BUILT_IN:
        return BUILT_IN[name]()
    return load_description(spec)
