"""The input-file digest recorded in schema.json: recomputable from its documented algorithm."""

from __future__ import annotations

import hashlib
import os
import zlib

import pytest

from ctrflow.ingest import output
from ctrflow.ingest.output import file_digest, file_digests
from ctrflow.errors import UserError


def tree_digest(data: bytes, piece: int) -> str:
    """The algorithm as `file_digest`'s docstring states it, written independently."""
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    crcs = b"".join(zlib.crc32(p).to_bytes(4, "big") for p in pieces)
    return "crc32-tree-1MiB:" + hashlib.sha256(crcs).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 5432, 70_001])
def test_file_digest_is_sha256_over_the_pieces_crc32s(tmp_path, monkeypatch, size):
    # small pieces so every boundary case (empty, exact multiple, short tail, several thread tasks) is hit
    monkeypatch.setattr(output, "PIECE_BYTES", 1000)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f", threads=3) == tree_digest(data, 1000)


def test_file_digest_of_a_small_file_is_the_sha256_of_its_crc32(tmp_path):
    data = b"1\t2\t\tdeadbeef\n" * 100
    (tmp_path / "f").write_bytes(data)
    inner = zlib.crc32(data).to_bytes(4, "big")
    assert file_digest(tmp_path / "f") == "crc32-tree-1MiB:" + hashlib.sha256(inner).hexdigest()


@pytest.mark.parametrize("block", [1, 999, 1000, 1001, 4096, 100_000])
def test_pieces_checksummed_block_by_block_give_the_file_digest(tmp_path, monkeypatch, block):
    monkeypatch.setattr(output, "PIECE_BYTES", 1000)
    data = os.urandom(23_456)
    (tmp_path / "f").write_bytes(data)
    checksums = output.PieceChecksums()
    for start in reversed(range(0, len(data), block)):  # in any order, as workers report them
        checksums.add(0, *output.piece_checksums(tmp_path / "f", start, min(start + block, len(data))))
    assert checksums.digest(0, tmp_path / "f") == tree_digest(data, 1000)


def test_a_missing_piece_gives_no_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "PIECE_BYTES", 1000)
    (tmp_path / "f").write_bytes(os.urandom(5000))
    checksums = output.PieceChecksums()
    for start in (0, 1000, 3000, 4000):  # the piece at 2000 never reported
        checksums.add(0, *output.piece_checksums(tmp_path / "f", start, start + 1000))
    assert checksums.digest(0, tmp_path / "f") is None


def test_file_digests_tell_files_apart_whatever_the_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "PIECE_BYTES", 64)
    paths = []
    for i, size in enumerate([200, 0, 200]):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * size)
    one, many = file_digests(paths, threads=1), file_digests(paths, threads=8)
    assert one == many and len(set(one)) == 3


def test_file_hasher_names_an_unreadable_file(tmp_path):
    with output.FileHasher([tmp_path / "missing.tsv"]) as hasher:
        with pytest.raises(UserError, match="missing.tsv: cannot read"):
            hasher.result()
