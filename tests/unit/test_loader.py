"""Loader: global batches depend only on (seed, epoch); ranks slice them; bad ids are named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ctrflow.data.loader import BatchLoader, ParquetDataset
from ctrflow.errors import UserError
from train_fixtures import one_thread, write_processed  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=1000, valid_rows=300, cardinality=20)


@pytest.fixture(scope="module")
def train_set(data_dir):
    return ParquetDataset(data_dir, "train", [20] * 26)


def collect(loader, epoch=0, start=0):
    return list(loader.batches(epoch, start))


def test_batches_are_a_function_of_seed_and_epoch(train_set):
    a = collect(BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=1))
    b = collect(BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=1, prefetch=0))
    other_epoch = collect(BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=1), epoch=1)
    assert len(a) == 1000 // 64
    for x, y in zip(a, b):
        assert torch.equal(x.sparse, y.sparse) and torch.equal(x.labels, y.labels)
    assert a[0].sparse.dtype == torch.int64 and a[0].dense.shape == (64, 13)
    assert not torch.equal(a[0].sparse, other_epoch[0].sparse)


def test_an_epoch_visits_each_row_at_most_once(train_set):
    batches = collect(BatchLoader(train_set, 100, shuffle=True, drop_last=True, seed=0))
    rows = torch.cat([b.dense for b in batches])
    assert len(rows) == 1000 and len(torch.unique(rows, dim=0)) == 1000


def test_rank_slices_concatenate_to_the_global_batch(train_set):
    whole = collect(BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=5))
    ranks = [collect(BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=5, rank=r, world_size=2))
             for r in range(2)]
    for i, batch in enumerate(whole):
        assert torch.equal(torch.cat([ranks[0][i].sparse, ranks[1][i].sparse]), batch.sparse)
        assert len(ranks[0][i]) == 32


def test_resuming_at_a_batch_index_continues_the_same_sequence(train_set):
    loader = BatchLoader(train_set, 64, shuffle=True, drop_last=True, seed=2)
    full, tail = collect(loader, epoch=3), collect(loader, epoch=3, start=5)
    assert len(tail) == len(full) - 5
    assert all(torch.equal(x.dense, y.dense) for x, y in zip(full[5:], tail))


def test_evaluation_keeps_the_last_partial_batch_in_file_order(data_dir):
    valid = ParquetDataset(data_dir, "valid")
    batches = collect(BatchLoader(valid, 128, shuffle=False, drop_last=False))
    assert [len(b) for b in batches] == [128, 128, 44]
    assert np.array_equal(torch.cat([b.labels for b in batches]).numpy(), valid.labels)


def test_id_outside_its_table_is_named_by_file_row_and_feature(tmp_path):
    root = write_processed(tmp_path, train_rows=50, valid_rows=10, cardinality=20, parts=1)
    part = root / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    c3 = table.column("C3").to_numpy().copy()
    c3[7] = 25
    pq.write_table(table.set_column(table.column_names.index("C3"), "C3", pa.array(c3)), part)
    with pytest.raises(UserError, match=r"part-00000.parquet: row 7: C3 id 25 .* 20 rows"):
        ParquetDataset(root, "train", [20] * 26)


def test_missing_split_or_column_is_a_user_error(tmp_path, data_dir):
    with pytest.raises(UserError, match="no part-"):
        ParquetDataset(tmp_path, "train")
    pq.write_table(pq.read_table(data_dir / "valid" / "part-00000.parquet").drop(["I4"]),
                   (tmp_path / "part-00000.parquet"))
    (tmp_path / "x").mkdir()
    (tmp_path / "part-00000.parquet").rename(tmp_path / "x" / "part-00000.parquet")
    with pytest.raises(UserError, match="missing column.*I4"):
        ParquetDataset(tmp_path, "x")


@pytest.mark.parametrize("shuffle,rank,world", [(True, 0, 1), (True, 1, 2), (False, 0, 1)])
def test_device_resident_split_gives_the_same_batches(train_set, shuffle, rank, world):
    kw = {"shuffle": shuffle, "drop_last": shuffle, "seed": 3, "rank": rank, "world_size": world, "prefetch": 0}
    host = BatchLoader(train_set, 64, **kw)
    resident = BatchLoader(train_set, 64, device="cpu", **kw)  # the GPU's code path, on the CPU
    for a, b in zip(collect(host, epoch=1, start=2), collect(resident, epoch=1, start=2), strict=True):
        for x, y in ((a.dense, b.dense), (a.sparse, b.sparse), (a.labels, b.labels)):
            assert x.dtype == y.dtype and torch.equal(x, y)
