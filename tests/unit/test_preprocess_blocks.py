"""How blocks travel between the passes: parsed once (fixed-size or variable binary C columns),
kept in the workers' memory or spilled to disk, transformed where they are held; same output."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

import ctrflow.ingest.run as preprocess_module
from ctrflow.ingest.parallel import WorkerPool, worker_index
from ctrflow.ingest.criteo.parsing import parse_block
from ctrflow.ingest.run import preprocess
from ctrflow.contract.criteo import DENSE, SPARSE
from ctrflow.contract.transform import transform_raw
from ctrflow.contract.vocab import Vocabularies, encode_keys
from ctrflow.errors import UserError
from tests.fixtures.preprocess import random_rows, row, write


def output_digests(out) -> dict[str, str]:
    """sha256 of every output file but stats.json (timings) and the metadata naming the output path."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("stats.json", "_file_list.txt")}


@pytest.mark.parametrize("memory_bytes", [0, 300_000])  # every block on disk; some held, some on disk
def test_blocks_on_disk_give_the_bytes_of_blocks_in_memory(tmp_path, monkeypatch, memory_bytes):
    src = write(tmp_path / "in.tsv", random_rows(1500, seed=5))
    options = dict(freq_threshold=2, valid_fraction=0.3, workers=2, chunk_rows=200)
    preprocess([src], out=tmp_path / "memory", **options)
    monkeypatch.setattr(preprocess_module, "MEMORY_BYTES", memory_bytes)
    preprocess([src], out=tmp_path / "disk", **options)
    assert output_digests(tmp_path / "disk") == output_digests(tmp_path / "memory")
    assert not list(tmp_path.glob("*.tmp-*"))  # the cache went with the temporary directory


def test_c_columns_parse_as_fixed_size_keys_or_binary_with_the_same_keys():
    hexes = "\n".join(row("1", {"I1": "5"}, {c: "68fd1e64" for c in SPARSE}) for _ in range(3)) + "\n"
    mixed = hexes + row("0", {}, {"C1": "short", "C2": "caf\u00e9xyz"}) + "\n"  # 5 bytes; 8 bytes, not ASCII
    fixed, variable = parse_block(hexes.encode(), binary=True), parse_block(mixed.encode(), binary=True)
    assert str(fixed.sparse[0].type) == "fixed_size_binary[8]" and str(variable.sparse[0].type) == "binary"
    strings = parse_block(mixed.encode())
    for j in (0, 1, 5):
        keys, other = encode_keys(variable.sparse[j])
        expected_keys, expected_other = encode_keys(strings.sparse[j])
        assert np.array_equal(keys, expected_keys) and (other is None) == (expected_other is None)
        assert np.array_equal(encode_keys(fixed.sparse[j])[0], expected_keys[:3])
    assert encode_keys(variable.sparse[0])[1].to_pylist()[-1] == "short"


@pytest.mark.parametrize("value", [b"ab\xffcdefg", b"\xff\xfe"])  # 8 bytes (a key's length) and 2 bytes
def test_invalid_utf8_in_a_categorical_column_is_a_bad_row(tmp_path, value):
    good = row("1", {}, {"C3": "aaaaaaaa"}).encode()
    bad = row("0").encode().split(b"\t")
    bad[1 + len(DENSE) + 4] = value  # C5
    src = tmp_path / "in.tsv"
    src.write_bytes(b"\n".join([good, b"\t".join(bad), good]) + b"\n")
    with pytest.raises(UserError, match=re.escape(str(src)) + ": line 2: not valid UTF-8"):
        preprocess([str(src)], out=tmp_path / "out", workers=1)
    preprocess([str(src)], out=tmp_path / "skip", workers=2, on_bad_rows="skip", freq_threshold=1)
    stats = json.loads((tmp_path / "skip" / "stats.json").read_text())
    assert (stats["rows_written"], stats["rows_rejected"]) == (2, 1)


def test_non_ascii_and_nul_values_get_the_ids_serving_gives(tmp_path):
    odd = ["caf\u00e9xyz", "\x00" * 8, "short", "\u00e9t\u00e9"]  # 8 bytes non-ASCII, 8 NULs, other lengths
    lines = random_rows(200, seed=6) + [row("1", {}, {"C7": v, "C8": v}) for v in odd * 3]
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", lines)], out=out, freq_threshold=2, workers=2, chunk_rows=64)
    fields = [line.split("\t") for line in lines]
    columns = {c: [f[1 + j] for f in fields] for j, c in enumerate((*DENSE, *SPARSE))}
    _, sparse = transform_raw(columns, Vocabularies.load(out))
    batch = pq.read_table(out / "train")
    assert np.array_equal(sparse, np.stack([batch.column(c).to_numpy() for c in SPARSE], axis=1))
    vocab = pq.read_table(out / "vocab" / "C7.parquet").column("value").to_pylist()
    assert set(odd) <= set(vocab)


class Where:
    """A stage that says which worker ran each task."""

    def start(self) -> None:
        """Nothing to build."""

    def handle(self, task: int) -> tuple[int, int]:
        """(task, worker)"""
        if task < 0:
            raise UserError(f"task {task}: negative")
        return task, worker_index()

    def finish(self) -> int:
        """The worker's index."""
        return worker_index()


def test_worker_pool_runs_stage_after_stage_in_order_on_the_routed_worker():
    with WorkerPool(2) as pool:
        assert [task for task, _ in pool.run(Where(), range(30))] == list(range(30))
        routed = list(pool.run(Where(), range(30), route=lambda task: 1 - task % 2))
        assert routed == [(task, 1 - task % 2) for task in range(30)]
        assert pool.finish() == [0, 1]
        with pytest.raises(UserError, match="task -1: negative"):
            list(pool.run(Where(), [3, -1, 4]))
        with pytest.raises(RuntimeError, match="leave the pool"):
            list(pool.run(Where(), [5]))
