"""Copies the python-backend models' `model.py` files into a repository.

What those files run (and the weights and vocabularies they read, written by
`serve.ranking.save_ranking_model` and `serve.preprocess.copy_vocabularies`) lives in
`ctrflow.serve`, which needs neither tritonclient nor this package.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "serve" / "models"


def copy_template(kind: str, version_dir: Path) -> Path:
    """Copy the `model.py` of `kind` ("preprocess" or "ranking") into a model version directory.

    Beside it goes an empty *file* named `__pycache__`: Python then cannot write the bytecode of
    `model.py` into the version folder (it skips it silently). A server polling the repository
    reloads every model whose folder changed, so without it each load would change the folder and
    be followed by a second, needless reload (Triton's embedded Python ignores
    PYTHONDONTWRITEBYTECODE).
    """
    version_dir.mkdir(parents=True, exist_ok=True)
    target = version_dir / "model.py"
    shutil.copy2(TEMPLATES / f"{kind}_model.py", target)
    (version_dir / "__pycache__").write_bytes(b"")
    return target
