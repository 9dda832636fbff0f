"""What the python-backend models of an exported Triton repository run, importable without Triton.

`serve/models/*.py` are the `model.py` files `ctrflow export` copies into the repository; they
only translate between Triton tensors and `serve.preprocess` / `serve.ranking`, so the logic is
here, where validation and the unit tests exercise it. `serve.preprocess` needs numpy, pyarrow and
the vocabularies only (no torch, no tritonclient), so the preprocessing model stays light.
`serve.tritonserver` starts a real `tritonserver` on a repository (`ctrflow serve`, the tests).

The ensemble's inputs are the raw columns the dataset description names as features, one BYTES
tensor each, in the feature contract's order (dense, then sparse): `raw_inputs(schema)`.
"""

from __future__ import annotations


def raw_inputs(features) -> tuple[str, ...]:
    """The raw columns a model reads, in order: one BYTES input of the served ensemble each.

    `features` is the feature contract (`ctrflow.contract.features.Features`) or a `Schema` holding one.
    Features keep their raw column's name, so these are the names in the dataset's files.
    """
    features = getattr(features, "features", features)
    return tuple(f.name for f in (*features.dense, *features.sparse))


def model_inputs(features) -> tuple[str, ...]:
    """The ranking model's input tensors: "dense" [B, num_dense] when there are dense features,
    "sparse" [B, slots] when there are sparse ones (Triton refuses zero-width tensors)."""
    features = getattr(features, "features", features)
    return tuple(name for name, width in (("dense", features.num_dense), ("sparse", features.slots)) if width)
