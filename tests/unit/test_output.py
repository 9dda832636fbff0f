"""The input-file digest recorded in schema.json: recomputable from its documented algorithm."""

from __future__ import annotations

import hashlib
import os

import pytest

from ctrflow.data import output
from ctrflow.data.output import file_digest, file_digests
from ctrflow.errors import UserError


def tree_digest(data: bytes, piece: int) -> str:
    """The algorithm as `file_digest`'s docstring states it, written independently."""
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    return "sha256-tree-64MiB:" + hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 5432])
def test_file_digest_is_sha256_over_the_pieces_sha256s(tmp_path, monkeypatch, size):
    # small pieces and reads so every boundary case (empty, exact multiple, short tail, many slices) is hit
    monkeypatch.setattr(output, "PIECE_BYTES", 1000)
    monkeypatch.setattr(output, "_READ_BYTES", 300)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f", threads=3) == tree_digest(data, 1000)


def test_file_digest_of_a_small_file_is_the_sha256_of_its_sha256(tmp_path):
    data = b"1\t2\t\tdeadbeef\n" * 100
    (tmp_path / "f").write_bytes(data)
    inner = hashlib.sha256(data).digest()
    assert file_digest(tmp_path / "f") == "sha256-tree-64MiB:" + hashlib.sha256(inner).hexdigest()


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
