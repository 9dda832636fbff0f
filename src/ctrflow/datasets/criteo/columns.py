"""Criteo's columns: label, 13 integer counts I1..I13, 26 categorical C1..C26 (8 hex digits).

Only the Criteo dataset's own modules name these; everything else reads the feature contract
(`ctrflow.features`) from `schema.json`.
"""

from __future__ import annotations

from typing import Mapping

from ctrflow.features import LABEL, Features

DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
RAW_COLUMNS = (LABEL, *DENSE, *SPARSE)  # the 40-column training layout; Kaggle test drops LABEL
TEST_COLUMNS = (*DENSE, *SPARSE)


def criteo_features(cardinalities: Mapping[str, int]) -> Features:
    """The feature contract of processed Criteo data with these vocabulary sizes (C1..C26)."""
    return Features.categorical({c: int(cardinalities[c]) for c in SPARSE}, DENSE)


def criteo_part_schema():
    """The Parquet parts' schema of processed Criteo data (`preprocess.output.part_schema`)."""
    from ctrflow.preprocess.output import part_schema

    return part_schema(criteo_features(dict.fromkeys(SPARSE, 0)))
