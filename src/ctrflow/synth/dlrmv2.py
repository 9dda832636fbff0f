"""`ctrflow synth --dataset dlrmv2`: Criteo-format day files with MLPerf DLRMv2's multi-hot fields.

The rows of `ctrflow synth --dataset criteo` (the same values, labels and teacher), except that each
categorical column of multi-hot size h > 1 (`ctrflow.contract.multihot.HOTNESS`: 15 of the 26 columns, 214 values a row)
holds h "|"-separated values: the row's value, then h - 1 more of the column's universe, a fixed
function of the value (`ctrflow.contract.multihot.expand`: MLPerf's expansion rule). `dlrmv2.yaml` beside the day
files describes them for `ctrflow preprocess --dataset`, which makes the multi-hot features of the
DLRMv2 shape (`ctrflow train --config mlperf-dlrmv2`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ctrflow.contract.criteo import DENSE, SPARSE
from ctrflow.contract.multihot import HOTNESS, SEPARATOR
from ctrflow.errors import UserError
from ctrflow.synth import criteo as criteo_synth
from ctrflow.synth.report import write_atomic

NAME = "dlrmv2"  # `ctrflow synth --dataset NAME`
DESCRIPTION_FILE = "dlrmv2.yaml"  # written beside the day files
FREQ_THRESHOLD = 2  # small synthetic days: a value seen twice gets its own row


def description_text() -> str:
    """`dlrmv2.yaml`: the dataset description of the day files (YAML, written without a YAML library)."""
    one = [c for c, h in zip(SPARSE, HOTNESS) if h == 1]
    bags = "\n".join(f'  {c}: {{separator: "{SEPARATOR}", max_length: {h}, pooling: sum}}'
                     for c, h in zip(SPARSE, HOTNESS) if h > 1)
    return f"""\
# Dataset description of the Criteo-format files with MLPerf DLRMv2's multi-hot fields, written by
# `ctrflow synth --dataset {NAME}`. Use it with:
#   ctrflow preprocess --dataset {DESCRIPTION_FILE} --train day_0.tsv --valid day_1.tsv --out DIR
name: {NAME}
format: tsv
header: false
quote: none
columns: [label, {", ".join(DENSE)}, {", ".join(SPARSE)}]
label: label
dense: [{", ".join(DENSE)}]
dense_type: integer
categorical: [{", ".join(one)}]
multi_hot:                  # every bag full (its h values), or empty where the value is missing
{bags}
freq_threshold: {{default: {FREQ_THRESHOLD}}}
"""


def synthesize(out, rows: int, days: int, seed: int, gzip: bool = False, tracker=None, drift: float = 0.0,
               click_rate: float | None = None) -> dict:
    """Write `out/day_{d}.tsv[.gz]` for d < days, `out/dlrmv2.yaml` and `out/synth.json` (module doc);
    returns synth.json's content with the seconds taken."""
    if drift:
        raise UserError(f"--dataset {NAME}: --drift is not offered (the days repeat one world)")
    report = criteo_synth.synthesize(out, rows, days, seed, gzip, tracker, hotness=HOTNESS, click_rate=click_rate)
    write_atomic(Path(out) / DESCRIPTION_FILE, description_text())
    seconds = report.pop("seconds")
    report.update(dataset=NAME, description=DESCRIPTION_FILE, hotness=dict(zip(SPARSE, HOTNESS)))
    write_atomic(Path(out) / "synth.json", json.dumps(report, indent=2) + "\n")
    return {**report, "seconds": seconds}


__all__ = ["DESCRIPTION_FILE", "NAME", "description_text", "synthesize"]
