"""`ctrflow predict`: raw rows -> probabilities equal to scoring the preprocessed rows (no skew)."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from tests.fixtures.serving import checkpoint, processed_data

from ctrflow.cli import main
from ctrflow.loaders.memory import ParquetDataset
from ctrflow.errors import UserError
from ctrflow.predict import predict, score
from ctrflow.checkpoint import load_model


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    raw, data = processed_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory)
    valid = ParquetDataset(data, "valid")
    expected = score(load_model(ckpt)[0], valid.dense, valid.sparse)
    return {"raw": raw, "data": data, "checkpoint": ckpt, "valid": valid, "expected": expected}


def test_predict_csv_matches_preprocessed_scores_in_order(artifacts, tmp_path, capsys):
    out = tmp_path / "scores.csv"
    assert main(["predict", "--checkpoint", str(artifacts["checkpoint"]), "--data", str(artifacts["data"]),
                 "--input", str(artifacts["raw"] / "day_1.tsv"), "--out", str(out)]) == 0
    table = pcsv.read_csv(out)
    assert table.column_names == ["probability", "label"]
    assert np.abs(table.column("probability").to_numpy() - artifacts["expected"]).max() <= 1e-6
    assert (table.column("label").to_numpy() == artifacts["valid"].labels).all()
    assert '"rows": 600' in capsys.readouterr().out


def test_predict_reads_gzip_kaggle_test_layout(artifacts, tmp_path):
    lines = (artifacts["raw"] / "day_1.tsv").read_bytes().rstrip(b"\n").split(b"\n")
    test_layout = tmp_path / "test.txt.gz"
    test_layout.write_bytes(gzip.compress(b"".join(line.split(b"\t", 1)[1] + b"\n" for line in lines[:100])))
    train_layout = tmp_path / "more.tsv"
    train_layout.write_bytes(b"\n".join(lines[100:]) + b"\n")
    summary = predict(artifacts["checkpoint"], artifacts["data"], [test_layout, train_layout], tmp_path / "s.parquet")
    table = pq.read_table(tmp_path / "s.parquet")
    assert summary["rows"] == table.num_rows == 600
    assert np.array_equal(table.column("probability").to_numpy(), artifacts["expected"])
    assert table.column("label").null_count == 100  # the test-layout rows have no label


def test_predict_bad_row_names_file_and_line(artifacts, tmp_path):
    lines = (artifacts["raw"] / "day_1.tsv").read_bytes().split(b"\n")[:5]
    fields = lines[3].split(b"\t")
    fields[4] = b"3.5"  # I4: not an integer
    lines[3] = b"\t".join(fields)
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(UserError, match=r"bad.tsv: line 4: .*I4"):
        predict(artifacts["checkpoint"], artifacts["data"], [bad], tmp_path / "s.csv")
    short = tmp_path / "short.tsv"
    short.write_bytes(b"1\t2\t3\n")
    with pytest.raises(UserError, match=r"short.tsv: line 1: expected 40 .* or 39"):
        predict(artifacts["checkpoint"], artifacts["data"], [short], tmp_path / "s.csv")
    with pytest.raises(UserError, match=r"\.csv or \.parquet"):
        predict(artifacts["checkpoint"], artifacts["data"], [bad], tmp_path / "s.json")


def test_predict_reads_the_descriptions_csv_and_matches_the_preprocessed_rows(tmp_path_factory, tmp_path):
    from tests.fixtures.serving import movielens_data

    raw, data = movielens_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory, "dlrm", data)
    valid = ParquetDataset(data, "valid")  # the feature contract of data/schema.json
    expected = score(load_model(ckpt)[0], valid.dense, valid.sparse)
    summary = predict(ckpt, data, [raw / "day_1.csv"], tmp_path / "scores.parquet")
    table = pq.read_table(tmp_path / "scores.parquet")
    assert summary["rows"] == table.num_rows == 800 and "auc" in summary
    assert np.abs(table.column("probability").to_numpy() - expected).max() <= 1e-6
    assert (table.column("label").to_numpy() == valid.labels).all()

    lines = (raw / "day_1.csv").read_text().splitlines()
    unlabelled = tmp_path / "unlabelled.csv"  # the label column left out, the columns reordered
    header = lines[0].split(",")
    order = [header.index(c) for c in ("genres", "price", "movieId", "userId", "age")]
    unlabelled.write_text("\n".join(",".join(line.split(",")[i] for i in order) for line in lines) + "\n")
    predict(ckpt, data, [unlabelled], tmp_path / "unlabelled.csv.out.csv")
    table = pcsv.read_csv(tmp_path / "unlabelled.csv.out.csv")
    assert table.column_names == ["probability"]
    assert np.abs(table.column("probability").to_numpy() - expected).max() <= 1e-6

    lines[5] = lines[5].replace(lines[5].split(",")[4], "cheap", 1) if lines[5].split(",")[4] else lines[5] + "x"
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines[:8]) + "\n")
    with pytest.raises(UserError, match=r"bad.csv: line 6: .*price"):
        predict(ckpt, data, [bad], tmp_path / "s.csv")


def test_predict_keeps_named_columns_and_quotes_header_and_values_alike(tmp_path_factory, tmp_path, capsys):
    from tests.fixtures.serving import movielens_data

    raw, data = movielens_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory, "dlrm", data)
    lines = (raw / "day_1.csv").read_text().splitlines()
    header = lines[0].split(",")
    source = tmp_path / "with_ids.csv"  # an id column beside the described ones, one value needing quotes
    ids = [f"imp-{i}" if i != 3 else 'imp "3", late' for i in range(len(lines) - 1)]
    quoted = ['"' + v.replace('"', '""') + '"' if "," in v else v for v in ids]
    source.write_text("\n".join([lines[0] + ",impression id"] + [f"{line},{q}" for line, q in zip(lines[1:], quoted)])
                      + "\n")
    out = tmp_path / "scores.csv"
    assert main(["predict", "--checkpoint", str(ckpt), "--data", str(data), "--input", str(source), "--out", str(out),
                 "--keep-columns", "impression id,userId"]) == 0
    written = out.read_text().splitlines()
    assert written[0] == "impression id,userId,probability,label"  # the header unquoted, as the values
    assert written[4].startswith('"imp ""3"", late",')
    table = pcsv.read_csv(out, convert_options=pcsv.ConvertOptions(column_types={"userId": "string"}))
    assert table.column("impression id").to_pylist() == ids
    assert table.column("userId").to_pylist() == [line.split(",")[header.index("userId")] for line in lines[1:]]
    plain = predict(ckpt, data, [raw / "day_1.csv"], tmp_path / "plain.parquet")
    assert plain["rows"] == table.num_rows
    assert np.array_equal(table.column("probability").to_numpy().astype(np.float32),  # exact in text
                          pq.read_table(tmp_path / "plain.parquet").column("probability").to_numpy())
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(ckpt), "--data", str(data), "--input", str(source), "--out",
                 str(out), "--keep-columns", "session"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ctrflow predict: error: {source}: --keep-columns: no column 'session' in the file "
                          f"(its columns: {header[0]}, ") and err.count("\n") == 1


def test_predict_on_a_file_without_rows_is_a_one_line_error(artifacts, tmp_path):
    for content, problem in ((b"", "the file is empty"), (b"\n", "the file is empty")):
        empty = tmp_path / "empty.tsv"
        empty.write_bytes(content)
        with pytest.raises(UserError, match=f"empty.tsv: {problem}"):
            predict(artifacts["checkpoint"], artifacts["data"], [empty], tmp_path / "s.csv")
        assert not (tmp_path / "s.csv").exists()
