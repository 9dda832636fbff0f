"""Engines (numpy, torch, cuDF) give the same output; an engine that cannot run says so in one line."""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pytest

from ctrflow.cli import main
from ctrflow.data.engines import CUDF_HINT, CpuEngine, KeyTable, TorchEngine, make_engine
from ctrflow.data.preprocess import preprocess
from ctrflow.data.schema import OOV_ID
from ctrflow.errors import UserError
from test_preprocess import random_rows, row, write
from test_preprocess_fanout import _assert_same_dataset


def test_torch_engine_output_is_identical_to_cpu(tmp_path):
    lines = random_rows(1500, seed=5) + [row("1", {"I5": "123456789012"}, {"C3": "short", "C4": "\u00e9t\u00e9"})] * 4
    src = write(tmp_path / "in.tsv", lines)
    outs = {}
    for engine in ("cpu", "torch"):
        outs[engine] = tmp_path / engine
        preprocess([src], out=outs[engine], freq_threshold=2, valid_fraction=0.2, workers=2, chunk_rows=400,
                   engine=engine, device="cpu", seed=3)
    _assert_same_dataset(outs["torch"], outs["cpu"])


def test_torch_kernels_match_numpy_on_edge_keys():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64, 5000, dtype=np.uint64, endpoint=False)
    keys[::7], keys[1::11] = 0, np.uint64(2**64 - 1)  # missing, and keys whose int64 view is negative
    cpu, torch = CpuEngine(), TorchEngine("cpu")
    for engine_result in (torch.unique_counts(keys),):
        expected = dict(zip(*cpu.unique_counts(keys)))
        assert dict(zip(*engine_result)) == expected and 0 not in expected
    vocab = np.unique(keys[keys != 0])[::2]
    table = KeyTable(vocab, np.arange(2, len(vocab) + 2, dtype=np.int32))
    assert np.array_equal(torch.lookup(table, keys), cpu.lookup(table, keys))
    assert (cpu.lookup(table, keys) == OOV_ID).sum() > 0
    empty = KeyTable(np.zeros(0, np.uint64), np.zeros(0, np.int32))
    assert np.array_equal(torch.lookup(empty, keys[:5]), cpu.lookup(empty, keys[:5]))
    raw = np.concatenate([np.arange(-5, 10_000), [2**40, 2**62]]).astype(np.int64)[:, None]
    assert cpu.transform_dense(raw).tobytes() == torch.transform_dense(raw).tobytes()


@pytest.mark.skipif(importlib.util.find_spec("cudf") is not None, reason="cuDF is installed here")
def test_cudf_engine_without_cudf_is_a_one_line_error(tmp_path, capsys):
    src = write(tmp_path / "in.tsv", random_rows(20, seed=1))
    with pytest.raises(UserError, match="cudf engine needs the `gpu` extra"):
        preprocess([src], out=tmp_path / "out", engine="cudf")
    assert main(["preprocess", "--train", src, "--out", str(tmp_path / "o"), "--engine", "cudf"]) == 2
    err = capsys.readouterr().err
    assert CUDF_HINT in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_torch_engine_on_a_missing_gpu_is_a_one_line_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    with pytest.raises(UserError, match="no CUDA GPU"):
        make_engine("torch", "cuda")
    src = write(tmp_path / "in.tsv", random_rows(20, seed=1))
    assert main(["preprocess", "--train", src, "--out", str(tmp_path / "o"), "--engine", "torch",
                 "--workers", "2"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_vocab_lookup_takes_an_engine(tmp_path):
    from ctrflow.data.vocab import ColumnVocab, encode_keys

    vocab = ColumnVocab("C1", pa.array(["aaaaaaaa", "xyz", "bbbbbbbb"]), np.array([5, 4, 3]))
    values = pa.array(["bbbbbbbb", "", "xyz", "zzzzzzzz", "aaaaaaaa", "q"])
    expected = [4, 0, 3, 1, 2, 1]
    assert vocab.lookup(*encode_keys(values)).tolist() == expected
    assert vocab.lookup(*encode_keys(values), engine=TorchEngine("cpu")).tolist() == expected


def test_encode_keys_reads_sliced_and_chunked_strings():
    from ctrflow.data.vocab import encode_keys

    values = ["abcdef01", "", "xyz", "0123abcd", "q", "\x00" * 8, "ffffffff", ""]
    whole_keys, whole_other = encode_keys(pa.array(values))
    chunked = pa.chunked_array([pa.array(["zz"] + values[:3]).slice(1), pa.array(values[3:])])
    keys, other = encode_keys(chunked)
    assert np.array_equal(keys, whole_keys) and other.to_pylist() == whole_other.to_pylist()
    assert other.to_pylist() == [None, None, "xyz", None, "q", "\x00" * 8, None, None]
    assert keys[0] == int.from_bytes(b"abcdef01", "little") and keys[1] == 0 and keys[2] == 0
