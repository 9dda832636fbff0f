"""Engines (numpy workers, torch device) give the same output; an engine that cannot run says so in one line."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from ctrflow.cli import main
from ctrflow.ingest.run import preprocess
from ctrflow.errors import UserError
from tests.fixtures.preprocess import random_rows, row, write
from tests.fixtures.preprocess import assert_same_dataset


def test_gpu_engine_with_writer_threads_is_identical_to_cpu_workers(tmp_path):
    lines = random_rows(1500, seed=5) + [row("1", {"I5": "123456789012"})] * 4
    src = write(tmp_path / "in.tsv", lines)
    outs = {}
    for engine in ("cpu", "gpu"):
        outs[engine] = tmp_path / engine
        preprocess([src], out=outs[engine], freq_threshold=2, valid_fraction=0.2, workers=2, chunk_rows=400,
                   engine=engine, device="cpu", seed=3)
    assert_same_dataset(outs["gpu"], outs["cpu"])


@pytest.mark.parametrize("engine, message", [("cudf", "use --engine gpu"), ("torch", "must be one of cpu, gpu")])
def test_an_unknown_engine_is_a_one_line_error(tmp_path, capsys, engine, message):
    src = write(tmp_path / "in.tsv", random_rows(20, seed=1))
    with pytest.raises(UserError, match=message):
        preprocess([src], out=tmp_path / "out", engine=engine)
    for action in (["--train", src], ["count", "--input", src]):
        assert main(["preprocess", *action, "--out", str(tmp_path / "o"), "--engine", engine]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_vocab_lookup_gives_ids_oov_and_missing():
    from ctrflow.contract.vocab import ColumnVocab, encode_keys

    vocab = ColumnVocab("C1", pa.array(["aaaaaaaa", "xyz", "bbbbbbbb"]), np.array([5, 4, 3]))
    values = pa.array(["bbbbbbbb", "", "xyz", "zzzzzzzz", "aaaaaaaa", "q"])
    assert vocab.lookup(*encode_keys(values)).tolist() == [4, 0, 3, 1, 2, 1]


def test_encode_keys_reads_sliced_and_chunked_strings():
    from ctrflow.contract.vocab import encode_keys

    values = ["abcdef01", "", "xyz", "0123abcd", "q", "\x00" * 8, "ffffffff", ""]
    whole_keys, whole_other = encode_keys(pa.array(values))
    chunked = pa.chunked_array([pa.array(["zz"] + values[:3]).slice(1), pa.array(values[3:])])
    keys, other = encode_keys(chunked)
    assert np.array_equal(keys, whole_keys) and other.to_pylist() == whole_other.to_pylist()
    assert other.to_pylist() == [None, None, "xyz", None, "q", "\x00" * 8, None, None]
    assert keys[0] == int.from_bytes(b"abcdef01", "little") and keys[1] == 0 and keys[2] == 0
