"""Multi-hot list lengths: what each block saw, and what the whole input decides from them.

Each block reports, per multi-hot column, how many training and validation rows have lists of each
length, and (when no list of the block holds two values) which other likely separators its texts hold.
After the fit pass the reports decide a column's unset `max_length` (the longest training list: no
training value is cut), count the rows a list of which was cut (`truncated_rows`), and warn about a
column whose lists never split while its texts hold another separator (a wrong `separator` would make
every list one value).
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.description import Description
from ctrflow.contract.lists import Lists

LIKELY_SEPARATORS = (" ", ",", ";", "\t", "|")


def report_lengths(lists: Lists, rows: np.ndarray, train: np.ndarray, texts: pa.Array | None,
                   separator: str) -> dict:
    """One block's report of a column (`rows`: each row's list; `train`: bool per row; `texts`: the
    distinct texts split, or None for a list column): {"lengths": [[length, train rows, valid rows],
    ...], "separators": [...]}."""
    per_row = lists.lengths[rows]
    width = int(per_row.max(initial=0)) + 1
    train_rows = np.bincount(per_row[train], minlength=width)
    valid_rows = np.bincount(per_row[~train], minlength=width)
    lengths = [[int(k), int(train_rows[k]), int(valid_rows[k])] for k in np.flatnonzero(train_rows + valid_rows)]
    seen = []
    if texts is not None and width <= 2:  # no list of the block holds two values
        seen = [s for s in LIKELY_SEPARATORS if s != separator and pc.any(pc.match_substring(texts, s)).as_py()]
    return {"lengths": lengths, "separators": seen}


def settle_lengths(description: Description, records: list[dict]) -> tuple[Description, dict[str, int], list[str]]:
    """(the description with every max_length set, rows cut per multi-hot column, warnings) from the
    blocks' reports (`records[i]["lists"]`)."""
    lengths, separators = {}, {}
    for record in records:
        for name, report in (record.get("lists") or {}).items():
            table = lengths.setdefault(name, {})
            for length, train, valid in report["lengths"]:
                table[length] = np.add(table.get(length, (0, 0)), (train, valid))
            separators.setdefault(name, set()).update(report["separators"])
    longest = {name: max([k for k, (train, _) in lengths.get(name, {}).items() if train] or [1])
               for name in description.multi_hot}
    settled = description.with_max_lengths(longest)
    truncated = {name: int(sum(sum(rows) for k, rows in lengths.get(name, {}).items() if k > m.max_length))
                 for name, m in settled.multi_hot.items()}
    warnings = []
    for name, m in settled.multi_hot.items():
        if name not in lengths or max(lengths[name]) > 1:
            continue
        likely = [s for s in LIKELY_SEPARATORS if s in separators.get(name, ())]
        if likely:
            warnings.append(f"{description.source}: multi_hot {name}: no row's list holds more than one value "
                            f"split at {m.separator!r}, but its values hold {likely[0]!r}: is the "
                            f"separator {likely[0]!r}? (set multi_hot: {name}: separator)")
    return settled, truncated, warnings


def warn(warnings: list[str]) -> None:
    """Print each warning as one line on stderr."""
    for line in warnings:
        print(f"ctrflow preprocess: warning: {line}", file=sys.stderr)
