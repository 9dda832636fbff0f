"""The built-in description of the raw Criteo TSV (`--dataset criteo`), in the dataset-description format.

Forty tab-separated fields, no header, no quoting: the 0/1 label, I1..I13 (integer counts, may be
negative or empty) and C1..C26 (usually 8 hex digits, or empty). Written out as a file, it reads:

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

from ctrflow.datasets.criteo.columns import DENSE, RAW_COLUMNS, SPARSE
from ctrflow.datasets.description import DEFAULT_THRESHOLD, Description


def criteo_description(freq_threshold: int = DEFAULT_THRESHOLD) -> Description:
    """The raw Criteo TSV as a `Description` (schema.json's `dataset`: `{"name": "criteo", ...}`)."""
    return Description(format="tsv", label=RAW_COLUMNS[0], dense=DENSE, categorical=SPARSE, header=False,
                       delimiter="\t", quote=None, columns=RAW_COLUMNS, default_threshold=freq_threshold,
                       dense_type="integer", name="criteo", source="criteo")
