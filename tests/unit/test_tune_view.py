"""Threshold views: a higher frequency threshold re-maps ids from the kept counts, without raw data."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctrflow.errors import UserError
from ctrflow.contract.features import Feature, Features
from ctrflow.loaders.memory import ParquetDataset
from ctrflow.contract.vocab import vocab_hash
from ctrflow.contract.schema import LABEL, Schema
from ctrflow.tune.view import VIEW_FILE, threshold_view

NAMES = [f"C{i}" for i in range(1, 27)]  # C26 multi-hot; C2 has a threshold of its own
COUNTS = [40, 12, 9, 9, 7, 5, 4, 3, 3]  # preprocessed at threshold 3: every count >= 3


def _counts(name: str) -> list[int]:
    return [3, 3, 2, 1] if name == "C2" else COUNTS


def write_data(root, rows: int = 300, seed: int = 0):
    """Processed data with vocabularies (value, count, by descending count), two splits in two row
    groups, C26 a multi-hot bag of 3; preprocessed at threshold 3 (C2 at 1)."""
    rng = np.random.default_rng(seed)
    (root / "vocab").mkdir(parents=True)
    values = {}
    for name in NAMES:
        counts = _counts(name)
        table = pa.table({"value": [f"{name}_{k}" for k in range(len(counts))],
                          "count": pa.array(counts, pa.int64())})
        pq.write_table(table, root / "vocab" / f"{name}.parquet")
        values[name] = table.column("value")
    sparse = [Feature(n, "categorical", cardinality=len(_counts(n)) + 2) for n in NAMES[:-1]]
    sparse.append(Feature("C26", "multi_hot", cardinality=len(COUNTS) + 2, max_length=3, pooling="mean"))
    features = Features(dense=(Feature("I1", "dense", transform="log1p"),), sparse=tuple(sparse))
    for split in ("train", "valid"):
        (root / split).mkdir()
        columns = {LABEL: pa.array(rng.integers(0, 2, rows).astype(np.float32)),
                   "I1": pa.array(rng.random(rows).astype(np.float32))}
        for f in sparse[:-1]:
            columns[f.name] = pa.array(rng.integers(0, f.cardinality, rows).astype(np.int32))
        bags = rng.integers(0, len(COUNTS) + 2, (rows, 3)).astype(np.int32)
        columns["C26"] = pa.FixedSizeListArray.from_arrays(pa.array(bags.ravel()), 3)
        schema = pa.schema([pa.field(k, v.type, nullable=False) for k, v in columns.items()])
        pq.write_table(pa.table(columns, schema=schema), root / split / "part-00000.parquet",
                       row_group_size=rows // 2, compression="zstd")
    Schema(cardinalities=features.cardinalities(), features=features, freq_threshold=3,
           rows={"train": rows, "valid": rows}, vocab_hash=vocab_hash(values),
           dataset={"freq_threshold": {"default": 3, "C2": 1}}).save(root / "schema.json")
    (root / "stats.json").write_text('{"rows_read": 600}\n')
    return root


@pytest.fixture
def data(tmp_path):
    return write_data(tmp_path / "processed")


def read(path, column):
    return pq.read_table(path).column(column).combine_chunks()


def test_a_higher_threshold_keeps_a_prefix_and_maps_the_rest_to_oov(data, tmp_path):
    view = threshold_view(data, 7, tmp_path / "views")
    assert view == tmp_path / "views" / "threshold_7"
    schema = Schema.load(view)
    kept = sum(c >= 7 for c in COUNTS)  # 5 values
    assert schema.freq_threshold == 7 and schema.cardinalities["C1"] == kept + 2
    assert schema.cardinalities["C2"] == 4 + 2  # its own threshold: untouched
    assert [f.cardinality for f in schema.features.sparse][-1] == kept + 2
    assert schema.dataset["freq_threshold"] == {"default": 7, "C2": 1}
    assert pq.read_table(view / "vocab" / "C1.parquet").column("count").to_pylist() == COUNTS[:kept]
    for split in ("train", "valid"):
        before, after = data / split / "part-00000.parquet", view / split / "part-00000.parquet"
        old, new = read(before, "C1").to_numpy(), read(after, "C1").to_numpy()
        assert np.array_equal(new, np.where(old >= kept + 2, 1, old))  # 0 and 1 stay, kept ids keep their id
        assert np.array_equal(read(after, "C2").to_numpy(), read(before, "C2").to_numpy())
        bags_old = read(before, "C26").flatten().to_numpy()
        bags_new = read(after, "C26").flatten().to_numpy()
        assert np.array_equal(bags_new, np.where(bags_old >= kept + 2, 1, bags_old))
        assert pq.ParquetFile(after).metadata.num_row_groups == 2
        assert pq.ParquetFile(after).schema_arrow == pq.ParquetFile(before).schema_arrow
        assert np.array_equal(read(after, LABEL).to_numpy(), read(before, LABEL).to_numpy())
    assert schema.vocab_hash == vocab_hash({n: read(view / "vocab" / f"{n}.parquet", "value") for n in NAMES})
    assert schema.vocab_hash != Schema.load(data).vocab_hash
    assert json.loads((view / VIEW_FILE).read_text())["kept"]["C1"] == kept
    assert (view / "stats.json").read_text() == (data / "stats.json").read_text()


def test_the_loaders_read_a_view_with_ids_inside_its_tables(data, tmp_path):
    view = threshold_view(data, 9, tmp_path / "views")
    sizes = Schema.load(view).table_sizes()
    dataset = ParquetDataset(view, "train", sizes)  # checks every id against its table
    assert len(dataset) == 300 and int(dataset.sparse.max()) < max(sizes)
    with pytest.raises(UserError, match="outside its embedding table"):  # the source's ids do not fit the view's tables
        ParquetDataset(data, "train", sizes)


def test_a_view_is_written_once_and_rebuilt_when_the_source_changes(data, tmp_path):
    view = threshold_view(data, 5, tmp_path / "views")
    stamp = (view / "schema.json").stat().st_mtime_ns
    assert threshold_view(data, 5, tmp_path / "views") == view
    assert (view / "schema.json").stat().st_mtime_ns == stamp
    schema = Schema.load(data)
    Schema(**{**schema.__dict__, "vocab_hash": "another"}).save(data / "schema.json")  # preprocessed again
    assert threshold_view(data, 5, tmp_path / "views") == view
    assert json.loads((view / VIEW_FILE).read_text())["source_vocab_hash"] == "another"
    assert not list((tmp_path / "views").glob("*.tmp-*"))


def test_the_preprocessing_threshold_is_the_data_itself(data, tmp_path):
    assert threshold_view(data, 3, tmp_path / "views") == data.resolve()
    assert not (tmp_path / "views").exists()


def test_a_threshold_below_the_preprocessing_one_is_refused(data, tmp_path):
    with pytest.raises(UserError, match="below the threshold .* preprocessed with \\(3\\).*lower --freq-threshold"):
        threshold_view(data, 2, tmp_path / "views")


def test_vocabularies_out_of_count_order_are_refused(data, tmp_path):
    pq.write_table(pa.table({"value": ["a", "b"] + [f"x{i}" for i in range(7)],
                             "count": pa.array([3, 5] + [3] * 7, pa.int64())}), data / "vocab" / "C1.parquet")
    with pytest.raises(UserError, match="C1.parquet: counts are not in descending order"):
        threshold_view(data, 4, tmp_path / "views")
