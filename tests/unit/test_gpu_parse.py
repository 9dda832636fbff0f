"""`--engine gpu` (device parsing, here on torch's CPU device) gives exactly the CPU engine's output,
errors and bad-row accounting; the device parser flags every line it does not take."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from ctrflow.cli import main
from ctrflow.ingest.criteo.gpu_parse import Tables, hex_strings, hex_values, parse_lines
from ctrflow.ingest.run import preprocess
from ctrflow.errors import UserError
from tests.fixtures.preprocess import random_rows, row, write
from tests.fixtures.preprocess import assert_same_dataset


def _both(tmp_path, train, valid=(), **options):
    outs = {}
    for engine in ("cpu", "gpu"):
        outs[engine] = tmp_path / engine
        preprocess(train, valid, out=outs[engine], engine=engine, device="cpu", workers=1, **options)
    return outs


def test_gpu_engine_output_is_identical_to_cpu(tmp_path):
    lines = random_rows(1200, seed=5) + [row("1", {"I5": "123456789012", "I2": "-7", "I3": "007"})] * 3
    train = write(tmp_path / "train.tsv", lines)
    zipped = tmp_path / "more.tsv.gz"
    zipped.write_bytes(gzip.compress("".join(x + "\n" for x in random_rows(500, seed=6)).encode()))
    (tmp_path / "valid.tsv").write_text("\n".join(random_rows(300, seed=7)))  # no final newline
    outs = _both(tmp_path, [train, str(zipped)], [str(tmp_path / "valid.tsv")], freq_threshold=2, chunk_rows=170)
    assert_same_dataset(outs["gpu"], outs["cpu"])


def test_gpu_engine_split_is_identical_to_cpu(tmp_path):
    train = write(tmp_path / "train.tsv", random_rows(1500, seed=8))
    outs = _both(tmp_path, [train], freq_threshold=3, valid_fraction=0.3, seed=4, chunk_rows=400)
    assert_same_dataset(outs["gpu"], outs["cpu"])


def test_gpu_engine_skips_bad_rows_like_cpu(tmp_path):
    lines = random_rows(900, seed=9)
    lines[3] = row("2")  # bad label
    lines[400] = lines[400] + "\textra"  # 41 fields
    lines[401] = row("0", {"I4": "12x"})  # not an integer
    lines[402] = ""  # an empty line
    lines[700] = row("1", {"I1": "+5"}, {"C2": "0000abcd"})  # a '+': the CPU parser decides
    src = write(tmp_path / "in.tsv", lines)
    outs = _both(tmp_path, [src], freq_threshold=2, valid_fraction=0.2, chunk_rows=150, on_bad_rows="skip")
    assert_same_dataset(outs["gpu"], outs["cpu"])
    rejected = (outs["gpu"] / "rejected.tsv").read_text()
    assert rejected == (outs["cpu"] / "rejected.tsv").read_text() and len(rejected.splitlines()) >= 5


def test_gpu_engine_stops_at_the_first_bad_row_like_cpu(tmp_path, capsys):
    lines = random_rows(600, seed=10)
    lines[517] = lines[517].replace("\t", "\t\t", 1)
    src = write(tmp_path / "in.tsv", lines)
    messages = []
    for engine in ("cpu", "gpu"):
        with pytest.raises(UserError) as err:
            preprocess([src], out=tmp_path / engine, engine=engine, device="cpu", workers=1, chunk_rows=100)
        messages.append(str(err.value))
        assert not (tmp_path / engine).exists()
    assert messages[0] == messages[1] and "line 518" in messages[1]
    assert main(["preprocess", "--train", src, "--out", str(tmp_path / "o"), "--engine", "gpu", "--device", "cpu"]) == 2
    assert "line 518" in capsys.readouterr().err


def test_gpu_engine_truncated_gzip_is_reported_like_cpu(tmp_path):
    whole = gzip.compress("".join(x + "\n" for x in random_rows(400, seed=11)).encode())
    src = tmp_path / "cut.tsv.gz"
    src.write_bytes(whole[: len(whole) * 2 // 3])
    messages = []
    for engine in ("cpu", "gpu"):
        with pytest.raises(UserError, match="truncated gzip") as err:
            preprocess([str(src)], out=tmp_path / engine, engine=engine, device="cpu", workers=1, chunk_rows=100)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    outs = _both(tmp_path / "skip", [str(src)], chunk_rows=100, on_bad_rows="skip")
    assert_same_dataset(outs["gpu"], outs["cpu"])


def test_gpu_engine_other_strings_take_the_cpu_path(tmp_path):
    lines = random_rows(500, seed=12) + [row("1", {}, {"C3": "short", "C4": "ABCDEF01"})] * 3
    src = write(tmp_path / "in.tsv", lines)
    outs = _both(tmp_path, [src], freq_threshold=2, chunk_rows=200)
    assert_same_dataset(outs["gpu"], outs["cpu"])


def test_gpu_engine_on_a_missing_gpu_is_a_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    src = write(tmp_path / "in.tsv", random_rows(20, seed=1))
    with pytest.raises(UserError, match="no CUDA GPU"):
        preprocess([src], out=tmp_path / "o", engine="gpu", device="cuda")


def test_parse_lines_decodes_fields_and_flags_the_rest():
    good = row("1", {"I1": "-12", "I2": "0", "I13": "999999999999999999"}, {"C1": "00ff00aa", "C26": "ffffffff"})
    bad = [row("1", {"I1": "1" * 19}), row("0", {}, {"C1": "00FF00AA"}), row("0", {}, {"C2": "abc"}),
           row("0", {"I3": "-"}), row("0", {"I3": "4-"}), row("01"), good + "\t", good.replace("\t", "\t\r", 1)]
    data = "".join(x + "\n" for x in [good] + bad).encode()
    buf = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    parsed = parse_lines(torch, Tables(torch, "cpu"), buf)
    assert parsed.flagged.tolist() == [False] + [True] * len(bad)
    assert parsed.label[0] == 1 and parsed.dense[:, 0].tolist() == [-12, 0] + [0] * 10 + [999999999999999999]
    assert parsed.dense_missing[:, 0].tolist() == [False, False] + [True] * 10 + [False]
    assert parsed.sparse[0, 0] == 0x00FF00AA and parsed.sparse[25, 0] == 0xFFFFFFFF and parsed.sparse[1, 0] == -1


def test_hex_keys_round_trip():
    values = np.array([0, 1, 0xABCDEF01, 0xFFFFFFFF], dtype=np.int64)
    keys = hex_strings(values)
    assert keys[2].tobytes() == b"abcdef01"
    assert hex_values(np.append(keys, np.uint64(0))).tolist() == values.tolist() + [-1]
    assert hex_values(np.frombuffer(b"ABCDEF01", dtype="<u8")) is None


def test_gpu_engine_output_is_the_same_over_many_groups_and_off_device(tmp_path, monkeypatch):
    from ctrflow.ingest.criteo import gpu_engine, gpu_read

    lines = random_rows(2000, seed=13)
    lines[1500] = row("3")  # a bad row in a later group
    src = write(tmp_path / "in.tsv", lines)
    monkeypatch.setattr(gpu_read, "GROUP_BYTES", 50_000)  # many groups of a few blocks each
    monkeypatch.setattr(gpu_engine.GpuEngine, "_memory_budget", lambda self: 100_000)  # most groups off the device
    outs = _both(tmp_path, [src], freq_threshold=2, valid_fraction=0.25, chunk_rows=90, on_bad_rows="skip")
    assert_same_dataset(outs["gpu"], outs["cpu"])
    assert (outs["gpu"] / "rejected.tsv").read_text() == (outs["cpu"] / "rejected.tsv").read_text()
