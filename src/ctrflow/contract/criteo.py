"""Criteo's columns and its built-in description (`--dataset criteo`): label, 13 integer counts
I1..I13, 26 categorical C1..C26 (8 hex digits).

Only the Criteo dataset's own modules name these; everything else reads the feature contract
(`ctrflow.contract.features`) from `schema.json`.

Forty tab-separated fields, no header, no quoting: the 0/1 label, I1..I13 (integer counts, may be
negative or empty) and C1..C26 (usually 8 hex digits, or empty). Written out as a description file,
it reads:

```yaml
name: criteo
format: tsv
header: false
delimiter: "\\t"
quote: null
columns: [label, I1, ..., I13, C1, ..., C26]
label: label
dense: [I1, ..., I13]
categorical: [C1, ..., C26]
freq_threshold: {default: 6}
transform: {default: log1p}
dense_type: integer
```
"""

from __future__ import annotations

from typing import Mapping

from ctrflow.contract.description import DEFAULT_THRESHOLD, Description
from ctrflow.contract.features import LABEL, Features

DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
RAW_COLUMNS = (LABEL, *DENSE, *SPARSE)  # the 40-column training layout; Kaggle test drops LABEL
TEST_COLUMNS = (*DENSE, *SPARSE)


def criteo_features(cardinalities: Mapping[str, int]) -> Features:
    """The feature contract of processed Criteo data with these vocabulary sizes (C1..C26)."""
    return Features.categorical({c: int(cardinalities[c]) for c in SPARSE}, DENSE)


def criteo_description(freq_threshold: int = DEFAULT_THRESHOLD) -> Description:
    """The raw Criteo TSV as a `Description` (schema.json's `dataset`: `{"name": "criteo", ...}`)."""
    return Description(format="tsv", label=RAW_COLUMNS[0], dense=DENSE, categorical=SPARSE, header=False,
                       delimiter="\t", quote=None, columns=RAW_COLUMNS, default_threshold=freq_threshold,
                       dense_type="integer", name="criteo", source="criteo")
