"""Loader: global batches depend only on (seed, epoch); ranks slice them; bad ids are named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ctrflow.loaders.memory import BatchLoader, ParquetDataset
from ctrflow.errors import UserError
from tests.fixtures.training import write_processed


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
    with pytest.raises(UserError, match="no schema.json"):  # the loaders read the feature contract there
        ParquetDataset(tmp_path, "x")
    (tmp_path / "schema.json").write_text((data_dir / "schema.json").read_text())
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


# --- streaming loader (ctrflow.loaders.stream): row groups through lanes and shuffle windows ---------------------

from ctrflow.loaders.stream import StreamLoader, choose_loader  # noqa: E402
from ctrflow.loaders.stream_plan import ParquetIndex  # noqa: E402


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    """1000 train rows in 3 parts of row groups of 70 rows: lanes and windows cut through row groups."""
    root = write_processed(tmp_path_factory.mktemp("stream"), train_rows=1000, valid_rows=10, cardinality=20, parts=3)
    for part in sorted((root / "train").glob("part-*.parquet")):
        pq.write_table(pq.read_table(part), part, row_group_size=70)
    return root


def stream(root, batch=64, **kw):
    kw = {"seed": 1, "window_rows": 128, "table_sizes": [20] * 26, "threads": 2, **kw}
    return StreamLoader(ParquetIndex(root, "train"), batch, **kw)


def rows_of(batches):
    """[n, 40] float64 rows (label, dense, ids) of a list of batches, in batch order."""
    return np.concatenate([np.concatenate([b.labels[:, None].double().numpy(), b.dense.double().numpy(),
                                           b.sparse.double().numpy()], axis=1) for b in batches])


def sorted_rows(rows):
    return rows[np.lexsort(rows.T[::-1])]


def test_stream_epoch_reads_each_row_of_the_split_once(stream_dir):
    loader = stream(stream_dir)
    batches = collect(loader)
    split = ParquetDataset(stream_dir, "train")
    everything = np.concatenate([split.labels[:, None], split.dense, split.sparse], axis=1).astype(np.float64)
    got = rows_of(batches)
    assert len(batches) == len(loader) == 1000 // 64 and all(len(b) == 64 for b in batches)
    assert batches[0].sparse.dtype == torch.int64 and batches[0].dense.dtype == torch.float32
    assert len(np.unique(got, axis=0)) == len(got) == 960  # 40 rows dropped: fewer than a batch + lanes
    known = {row.tobytes() for row in everything}
    assert all(row.tobytes() in known for row in got)  # whole rows: label, dense and ids travel together
    assert not np.array_equal(got[:64], everything[:64])  # shuffled, not file order


def test_stream_batches_depend_on_seed_and_epoch_only(stream_dir):
    a = rows_of(collect(stream(stream_dir, threads=1), epoch=2))
    b = rows_of(collect(stream(stream_dir, threads=3), epoch=2))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, rows_of(collect(stream(stream_dir), epoch=3)))
    assert not np.array_equal(a, rows_of(collect(stream(stream_dir, seed=2), epoch=2)))


def test_stream_resume_at_a_batch_index_continues_the_same_sequence(stream_dir):
    loader = stream(stream_dir)
    full, tail = collect(loader, epoch=1), collect(loader, epoch=1, start=5)  # batch 5: inside a window
    assert np.array_equal(rows_of(full[5:]), rows_of(tail))
    assert collect(loader, epoch=1, start=len(loader)) == []


@pytest.mark.parametrize("world", [2, 4])
def test_stream_global_batches_are_the_same_rows_for_any_process_count(stream_dir, world):
    whole = collect(stream(stream_dir))
    ranks = [collect(stream(stream_dir, rank=r, world_size=world)) for r in range(world)]
    assert all(len(r) == len(whole) for r in ranks)
    for i, batch in enumerate(whole):
        assert all(len(r[i]) == 64 // world for r in ranks)
        union = rows_of([r[i] for r in ranks])
        assert np.array_equal(sorted_rows(union), sorted_rows(rows_of([batch])))


def test_stream_without_shuffle_reads_in_file_order(stream_dir):
    batches = collect(stream(stream_dir, shuffle=False, lanes=1))
    split = ParquetDataset(stream_dir, "train")
    assert np.array_equal(torch.cat([b.labels for b in batches]).numpy(), split.labels[:960])


def test_stream_names_the_file_row_group_and_row_of_bad_data(tmp_path):
    root = write_processed(tmp_path, train_rows=200, valid_rows=10, cardinality=20, parts=2)
    part = root / "train" / "part-00001.parquet"
    table = pq.read_table(part)
    c3 = table.column("C3").to_numpy().copy()
    c3[7] = -1
    pq.write_table(table.set_column(table.column_names.index("C3"), "C3", pa.array(c3)), part, row_group_size=50)
    with pytest.raises(UserError, match=r"part-00001.parquet: row 7: C3 id -1 .* 20 rows"):
        collect(stream(root, shuffle=False, batch=8))
    i5 = pa.array(table.column("I5").to_numpy(), mask=np.arange(100) == 60)
    pq.write_table(table.set_column(table.column_names.index("I5"), "I5", i5), part, row_group_size=50)
    with pytest.raises(UserError, match=r"part-00001.parquet: row group 1: column I5 has 1 null"):
        collect(stream(root, shuffle=False, batch=8))
    part.write_bytes(b"not parquet")
    with pytest.raises(UserError, match=r"part-00001.parquet: cannot read Parquet"):
        ParquetIndex(root, "train")
    with pytest.raises(UserError, match="multiple of the 3 processes"):
        StreamLoader(ParquetIndex(root, "valid"), 8, world_size=3)


def test_auto_loader_streams_only_a_split_over_the_memory_budget():
    cpu = torch.device("cpu")
    assert choose_loader("auto", 10 << 30, cpu, host_bytes=64 << 30, local_processes=1) == "memory"
    assert choose_loader("auto", 10 << 30, cpu, host_bytes=64 << 30, local_processes=2) == "stream"
    assert choose_loader("stream", 1, cpu) == "stream" and choose_loader("memory", 1 << 50, cpu) == "memory"
    with pytest.raises(UserError, match="--loader"):
        choose_loader("disk", 1, cpu)


def test_train_with_the_stream_loader_resumes_on_the_same_trajectory(stream_dir, tmp_path):
    import json

    from ctrflow.cli import main
    from ctrflow.config import DataConfig, TrainConfig
    from ctrflow.train.loop import train

    def losses(out):
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    def run(out, **kw):
        data = DataConfig(path=str(stream_dir), batch_size=64, loader="stream", shuffle_window=128, loader_threads=2)
        train(TrainConfig(out=str(out), data=data, progress=False, log_every=1, epochs=2, deterministic=True, **kw))
        return losses(out)

    assert main(["train", "--data", str(stream_dir), "--out", str(tmp_path / "straight"), "--loader", "stream",
                 "--shuffle-window", "128", "--loader-threads", "2", "--batch-size", "64", "--max-steps", "20",
                 "--epochs", "2", "--log-every", "1", "--deterministic", "--no-progress", "--tracking-uri", "none"]) == 0
    straight = losses(tmp_path / "straight")
    run(tmp_path / "first", max_steps=9)
    resumed = run(tmp_path / "resumed", max_steps=20, resume=str(tmp_path / "first"))
    assert sorted(resumed) == list(range(1, 21))  # across the epoch boundary (15 steps an epoch)
    assert all(abs(resumed[s] - straight[s]) < 1e-5 for s in range(10, 21))


def test_stream_prefetched_epochs_give_the_same_batches_as_fresh_loaders(stream_dir):
    loader = stream(stream_dir, epochs=3)
    for epoch in range(3):
        got = collect(loader, epoch=epoch)
        assert np.array_equal(rows_of(got), rows_of(collect(stream(stream_dir), epoch=epoch)))
        assert (loader._next is not None) == (epoch < 2)  # the next epoch's first window is read ahead
    half = stream(stream_dir, epochs=3)
    for i, _ in enumerate(half.batches(0)):
        if i == 3:
            break
    assert half._next is None  # an epoch left half-way reads nothing ahead
    assert np.array_equal(rows_of(collect(half, epoch=1)), rows_of(collect(stream(stream_dir), epoch=1)))


def test_ids_beyond_32_bits_are_named_not_truncated(tmp_path):
    root = write_processed(tmp_path, train_rows=100, valid_rows=10, cardinality=20, parts=1)
    part = root / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    c5 = table.column("C5").to_numpy().astype(np.int64)
    c5[42] = (1 << 31) + 5
    pq.write_table(table.set_column(table.column_names.index("C5"), "C5", pa.array(c5)), part)
    with pytest.raises(UserError, match=r"part-00000.parquet: row 42: C5 id 2147483653 does not fit in 32 bits"):
        collect(stream(root, shuffle=False, batch=8, table_sizes=None))
    with pytest.raises(UserError, match=r"part-00000.parquet: row 42: C5 id 2147483653 does not fit in 32 bits"):
        ParquetDataset(root, "train")


# --- evaluation scan (ctrflow.loaders.scan): the whole split in order, one contiguous share per process ----------

from ctrflow.loaders.scan import ScanLoader  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_scan_reads_every_row_once_in_order_for_any_process_count(stream_dir, world):
    shares = [list(ScanLoader(ParquetIndex(stream_dir, "train"), 64, rank=r, world_size=world, window_rows=100,
                              table_sizes=[20] * 26, threads=2).batches()) for r in range(world)]
    split = ParquetDataset(stream_dir, "train")
    everything = np.concatenate([split.labels[:, None], split.dense, split.sparse], axis=1).astype(np.float64)
    assert len({len(share) for share in shares}) == 1  # same batch count: collectives stay in step
    assert np.array_equal(np.concatenate([rows_of(share) for share in shares]), everything)  # all 1000 rows
    assert all(len(b) <= 64 // world for share in shares for b in share)


def test_scan_limit_takes_the_first_rows_of_the_split(stream_dir):
    shares = [list(ScanLoader(ParquetIndex(stream_dir, "train"), 64, rank=r, world_size=2, limit_batches=3,
                              threads=2).batches()) for r in range(2)]
    split = ParquetDataset(stream_dir, "train")
    assert np.array_equal(torch.cat([b.labels for s in shares for b in s]).numpy(), split.labels[:192])
