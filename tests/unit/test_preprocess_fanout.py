"""Per-file fan-out (count → merge → transform → finalize) gives exactly the single-process output."""

from __future__ import annotations


import pytest

from ctrflow.cli import main
from ctrflow.ingest.run import preprocess
from tests.fixtures.preprocess import random_rows, row, write
from tests.fixtures.preprocess import assert_same_dataset


def _fan_out(tmp_path, files, valid_fraction=None, on_bad_rows="error", chunk_rows=150, engine="cpu"):
    """Run the four CLI actions as a KFP fan-out would, each file on its own 'machine'."""
    counts, parts = [], []
    for index, (path, split) in enumerate(files):
        counts.append(str(tmp_path / f"counts-{index}"))
        flags = ["--input", path, "--file-index", str(index), "--split", split, "--chunk-rows", str(chunk_rows),
                 "--on-bad-rows", on_bad_rows, "--seed", "7", "--engine", engine, "--device", "cpu"]
        flags += ["--valid-fraction", str(valid_fraction)] if valid_fraction else []
        assert main(["preprocess", "count", *flags, "--out", counts[-1]]) == 0
    merged = str(tmp_path / "merged")
    assert main(["preprocess", "merge", "--counts", *reversed(counts), "--out", merged, "--freq-threshold", "3"]) == 0
    for index, (path, split) in enumerate(files):
        parts.append(str(tmp_path / f"parts-{index}"))
        flags = ["--input", path, "--file-index", str(index), "--split", split, "--chunk-rows", str(chunk_rows),
                 "--on-bad-rows", on_bad_rows, "--seed", "7", "--engine", engine, "--device", "cpu"]
        flags += ["--valid-fraction", str(valid_fraction)] if valid_fraction else []
        assert main(["preprocess", "transform", *flags, "--vocab", merged, "--out", parts[-1]]) == 0
    out = tmp_path / "fanned"
    assert main(["preprocess", "finalize", "--counts", *counts, "--vocab", merged, "--parts", *parts,
                 "--out", str(out)]) == 0
    return out


def test_fan_out_per_file_equals_single_process(tmp_path):
    files = [(write(tmp_path / f"day_{i}.tsv", random_rows(700, seed=i)), "train") for i in range(2)]
    files.append((write(tmp_path / "valid.tsv", random_rows(400, seed=9)), "valid"))
    reference = tmp_path / "single"
    preprocess([p for p, s in files if s == "train"], [p for p, s in files if s == "valid"], reference,
               freq_threshold=3, workers=1, chunk_rows=150, seed=7, engine="gpu", device="cpu")
    assert_same_dataset(_fan_out(tmp_path, files, engine="gpu"), reference)


def test_fan_out_with_valid_fraction_and_skipped_rows(tmp_path):
    lines = random_rows(600, seed=3)
    lines[10] = row("2")  # a bad label: skipped and listed
    files = [(write(tmp_path / f"day_{i}.tsv", lines if i == 0 else random_rows(500, seed=4)), "train")
             for i in range(2)]
    reference = tmp_path / "single"
    preprocess([p for p, _ in files], out=reference, freq_threshold=3, valid_fraction=0.25, workers=2,
               chunk_rows=150, seed=7, on_bad_rows="skip")
    out = _fan_out(tmp_path, files, valid_fraction=0.25, on_bad_rows="skip")
    assert_same_dataset(out, reference)
    assert (out / "rejected.tsv").read_text() == (reference / "rejected.tsv").read_text()


def test_finalize_refuses_a_missing_transform_output(tmp_path, capsys):
    paths = [write(tmp_path / f"d{i}.tsv", random_rows(200, seed=i)) for i in range(2)]
    for i, path in enumerate(paths):
        argv = ["preprocess", "count", "--input", path, "--file-index", str(i), "--out", str(tmp_path / f"c{i}")]
        assert main(argv) == 0
    counts = [str(tmp_path / f"c{i}") for i in range(2)]
    assert main(["preprocess", "merge", "--counts", *counts, "--out", str(tmp_path / "m")]) == 0
    assert main(["preprocess", "transform", "--input", paths[0], "--vocab", str(tmp_path / "m"),
                 "--out", str(tmp_path / "p0")]) == 0
    code = main(["preprocess", "finalize", "--counts", *counts, "--vocab", str(tmp_path / "m"),
                 "--parts", str(tmp_path / "p0"), "--out", str(tmp_path / "out")])
    assert code == 2 and "expected 2 train parts, found 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_transform_of_an_uncounted_file_is_a_one_line_error(tmp_path, capsys):
    path = write(tmp_path / "a.tsv", random_rows(50, seed=1))
    assert main(["preprocess", "count", "--input", path, "--out", str(tmp_path / "c")]) == 0
    assert main(["preprocess", "merge", "--counts", str(tmp_path / "c"), "--out", str(tmp_path / "m")]) == 0
    code = main(["preprocess", "transform", "--input", path, "--file-index", "3", "--vocab", str(tmp_path / "m"),
                 "--out", str(tmp_path / "p")])
    assert code == 2 and "--file-index 3 was not counted" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["preprocess", "--out", "x"], ["preprocess", "--train", "a.tsv"]])
def test_single_run_still_needs_train_and_out(argv, capsys):
    assert main(argv) == 2 and "give --train FILE... and --out DIR" in capsys.readouterr().err


def test_transform_with_other_flags_than_count_is_refused(tmp_path, capsys):
    path = write(tmp_path / "a.tsv", random_rows(300, seed=1))
    assert main(["preprocess", "count", "--input", path, "--chunk-rows", "100", "--out", str(tmp_path / "c")]) == 0
    assert main(["preprocess", "merge", "--counts", str(tmp_path / "c"), "--out", str(tmp_path / "m")]) == 0
    code = main(["preprocess", "transform", "--input", path, "--chunk-rows", "50", "--vocab", str(tmp_path / "m"),
                 "--out", str(tmp_path / "p")])
    assert code == 2 and "differ from what `count` saw" in capsys.readouterr().err
