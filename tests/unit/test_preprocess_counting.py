"""Out-of-core value counting: runs spilled under a memory budget merge to the exact vocabulary."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ctrflow.ingest.counting import Counter, merge_vocabulary, mix, unmix
from ctrflow.contract.vocab import encode_keys


def test_mix_is_a_bijection():
    keys = np.random.default_rng(0).integers(0, 2**63, 10_000, dtype=np.uint64) * np.uint64(2)
    assert np.array_equal(unmix(mix(keys)), keys) and len(np.unique(mix(keys))) == len(np.unique(keys))


def test_spilled_runs_merge_to_exact_counts(tmp_path):
    rng = np.random.default_rng(1)
    values = np.array([f"{v:08x}" for v in range(3000)] + ["short", "a longer value"])
    counter = Counter(str(tmp_path), ["C1"], spill_entries=700)
    seen = []
    for _ in range(6):  # six blocks, several spills
        block = values[np.minimum(rng.zipf(1.3, 2000) - 1, len(values) - 1)]
        seen.append(block)
        counter.add("C1", *encode_keys(pa.array(block)))
        counter.spill_if_large()
    final = counter.finish()
    assert len(final["runs"]) > 2
    table, distinct = merge_vocabulary(final["runs"], [final["other"]["C1"]], 0, threshold=3, range_entries=200)
    uniques, counts = np.unique(np.concatenate(seen), return_counts=True)
    expected = sorted(((-c, v) for v, c in zip(uniques.tolist(), counts.tolist()) if c >= 3))
    assert table.column("value").to_pylist() == [v for _, v in expected]
    assert table.column("count").to_pylist() == [-c for c, _ in expected]
    assert distinct == len(uniques)
