"""Loaders read the feature contract: any dense / categorical / multi-hot set, batches in its layout."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ctrflow.errors import UserError
from ctrflow.evaluate.split import iter_split, split_parts
from ctrflow.loaders.layout import RowLayout
from ctrflow.loaders.memory import BatchLoader, ParquetDataset
from ctrflow.loaders.scan import ScanLoader
from ctrflow.loaders.stream import StreamLoader
from ctrflow.loaders.stream_plan import ParquetIndex
from ctrflow.contract.schema import Schema
from tests.fixtures.multihot import mixed_features, write_mixed

FEATURES = mixed_features(dense=2, categorical=2, multi_hot=2, cardinality=30, max_length=4)

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("mixed"), FEATURES, train_rows=600, valid_rows=200, parts=3,
                       row_group_size=70)


def expected_rows(root, split):
    """(labels, dense, sparse) as written, straight from Parquet with pyarrow."""
    labels, dense, sparse = [], [], []
    for part in sorted((root / split).glob("part-*.parquet")):
        t = pq.read_table(part)
        labels.append(t.column("label").to_numpy())
        dense.append(np.stack([t.column(f.name).to_numpy() for f in FEATURES.dense], axis=1))
        sparse.append(np.concatenate([np.stack(t.column(f.name).to_pylist()).reshape(len(t), -1)
                                      for f in FEATURES.sparse], axis=1))
    return np.concatenate(labels), np.concatenate(dense), np.concatenate(sparse)


def rows_of(batches):
    return np.concatenate([np.concatenate([b.labels[:, None].double().numpy(), b.dense.double().numpy(),
                                           b.sparse.double().numpy()], axis=1) for b in batches])


def test_layout_gives_each_multi_hot_feature_its_max_length_words():
    layout = RowLayout(FEATURES)
    assert FEATURES.slots == 1 + 1 + 4 + 5 and layout.words == 1 + 2 + 11 and layout.row_bytes == 56
    m1 = next(c for c in layout.columns if c.name == "m1")
    assert (m1.first, m1.width, m1.feature) == (1 + 2 + 1 + 1 + 4, 5, 3)
    assert layout.slot_limits([30, 31, 30, 33]).tolist() == [30, 31] + [30] * 4 + [33] * 5


def test_memory_loader_batches_hold_every_slot_in_feature_order(mixed_dir):
    labels, dense, sparse = expected_rows(mixed_dir, "valid")
    data = ParquetDataset(mixed_dir, "valid", Schema.load(mixed_dir).table_sizes())
    batches = list(BatchLoader(data, 64, shuffle=False, drop_last=False, prefetch=0).batches())
    assert batches[0].dense.shape == (64, 2) and batches[0].sparse.shape == (64, FEATURES.slots)
    assert batches[0].sparse.dtype == torch.int64 and batches[0].dense.dtype == torch.float32
    assert np.array_equal(torch.cat([b.sparse for b in batches]).numpy(), sparse)
    assert np.array_equal(torch.cat([b.dense for b in batches]).numpy(), dense)
    assert np.array_equal(torch.cat([b.labels for b in batches]).numpy(), labels)
    assert (sparse[:, 2:6] == 0).any() and (sparse[:, 2:6] != 0).any()  # padding and ids both present


def test_stream_and_scan_loaders_give_the_memory_loaders_rows(mixed_dir):
    split = ParquetDataset(mixed_dir, "train")
    everything = np.concatenate([split.labels[:, None], split.dense, split.sparse], axis=1).astype(np.float64)
    sizes = Schema.load(mixed_dir).table_sizes()
    streamed = rows_of(list(StreamLoader(ParquetIndex(mixed_dir, "train"), 64, seed=1, window_rows=128, lanes=4,
                                         table_sizes=sizes, threads=2).batches()))
    known = {row.tobytes() for row in everything}
    assert len(streamed) == 576 and len(np.unique(streamed, axis=0)) == 576
    assert all(row.tobytes() in known for row in streamed)  # whole rows: label, dense and every slot together
    for world in (1, 2):
        shares = [list(ScanLoader(ParquetIndex(mixed_dir, "train"), 64, rank=r, world_size=world, window_rows=100,
                                  table_sizes=sizes, threads=2).batches()) for r in range(world)]
        assert np.array_equal(np.concatenate([rows_of(s) for s in shares]), everything)
    evaluated = list(iter_split(split_parts(mixed_dir, "train"), sizes, batch_rows=100))
    assert np.array_equal(np.concatenate([s for _, _, s in evaluated]), split.sparse)
    assert np.array_equal(np.concatenate([d for _, d, _ in evaluated]), split.dense)


def write_bad_id(root, value):
    """Put `value` into row 7, third id, of m1 in the second train part; returns that part."""
    part = root / "train" / "part-00001.parquet"
    table = pq.read_table(part)
    ids = np.stack(table.column("m1").to_pylist()).astype(np.int32)
    ids[7, 2] = value
    column = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), 5)
    pq.write_table(table.set_column(table.column_names.index("m1"), "m1", column), part, row_group_size=50)
    return part


def test_a_multi_hot_id_outside_its_table_is_named_by_file_row_and_feature(tmp_path):
    root = write_mixed(tmp_path, FEATURES, train_rows=200, valid_rows=20, parts=2)
    write_bad_id(root, 33)
    sizes = Schema.load(root).table_sizes()
    pattern = r"part-00001.parquet: row 7: m1 id 33 is outside its embedding table of 33 rows"
    with pytest.raises(UserError, match=pattern):
        ParquetDataset(root, "train", sizes)
    with pytest.raises(UserError, match=pattern):
        list(StreamLoader(ParquetIndex(root, "train"), 8, shuffle=False, lanes=1, table_sizes=sizes,
                          threads=1).batches())
    with pytest.raises(UserError, match=pattern):
        list(ScanLoader(ParquetIndex(root, "train"), 8, table_sizes=sizes, threads=1).batches())
    with pytest.raises(UserError, match=pattern):
        list(iter_split(split_parts(root, "train"), sizes))
    write_bad_id(root, -3)
    with pytest.raises(UserError, match=r"part-00001.parquet: row 7: m1 id -3 is outside"):
        list(StreamLoader(ParquetIndex(root, "train"), 8, shuffle=False, lanes=1, table_sizes=sizes,
                          threads=1).batches())


def test_a_multi_hot_column_of_another_length_is_refused_before_reading(tmp_path):
    root = write_mixed(tmp_path, FEATURES, train_rows=100, valid_rows=20, parts=1)
    part = root / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    ids = np.stack(table.column("m0").to_pylist())[:, :3].astype(np.int32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), 3)
    pq.write_table(table.set_column(table.column_names.index("m0"), "m0", column), part)
    message = r"part-00000.parquet: column m0 has type fixed_size_list<element: int32>\[3\], expected"
    with pytest.raises(UserError, match=message):
        ParquetIndex(root, "train")
    with pytest.raises(UserError, match=message):
        ParquetDataset(root, "train")


@pytest.mark.parametrize("dense,categorical,multi_hot", [(0, 1, 2), (3, 0, 0), (0, 0, 1)])
def test_datasets_without_dense_or_without_sparse_features_load(tmp_path, dense, categorical, multi_hot):
    features = mixed_features(dense, categorical, multi_hot)
    root = write_mixed(tmp_path, features, train_rows=300, valid_rows=50, parts=2)
    sizes = Schema.load(root).table_sizes()
    memory = list(BatchLoader(ParquetDataset(root, "train", sizes), 32, shuffle=True, drop_last=True).batches())
    stream = list(StreamLoader(ParquetIndex(root, "train"), 32, lanes=2, window_rows=64, table_sizes=sizes,
                               threads=1).batches())
    scan = list(ScanLoader(ParquetIndex(root, "valid"), 32, table_sizes=sizes, threads=1).batches())
    for batches in (memory, stream, scan):
        assert batches[0].dense.shape == (32, dense) and batches[0].sparse.shape == (32, features.slots)
    assert sum(len(b) for b in scan) == 50


def test_criteo_shaped_rows_keep_their_160_byte_layout():
    from ctrflow.contract.criteo import criteo_features

    layout = RowLayout(criteo_features({f"C{i + 1}": 10 for i in range(26)}))
    assert (layout.words, layout.row_bytes, layout.first_id) == (40, 160, 14)
    assert [c.name for c in layout.columns][:3] == ["label", "I1", "I2"] and layout.columns[-1].name == "C26"
