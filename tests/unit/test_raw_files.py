"""`ctrflow.serve.raw_files`: raw files in a description's format read as the text columns a client
of the served ensemble sends; a malformed file named by file, line and column."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctrflow.errors import UserError
from ctrflow.features import Feature, Features
from ctrflow.schema import Schema
from ctrflow.serve import model_inputs, raw_inputs
from ctrflow.serve.raw_files import raw_format, read_raw_file

MOVIES = {"format": "csv", "header": True, "delimiter": ",", "label": "liked", "dense": ["price"],
          "categorical": ["userId"], "multi_hot": {"genres": {"separator": "|", "max_length": 3, "pooling": "sum"}}}


def schema(dataset: dict, dense=("price",), categorical=("userId",), multi_hot=("genres",)) -> Schema:
    features = Features(dense=tuple(Feature(n, "dense", transform="log1p") for n in dense),
                        sparse=tuple([Feature(n, "categorical", cardinality=10) for n in categorical]
                                     + [Feature(n, "multi_hot", cardinality=10, max_length=3, pooling="sum")
                                        for n in multi_hot]))
    return Schema(cardinalities=features.cardinalities(), freq_threshold=2, rows={"train": 1, "valid": 1},
                  vocab_hash="0" * 64, features=features, dataset=dataset)


def read_all(path, fmt) -> tuple[dict, np.ndarray | None, list[int]]:
    blocks = list(read_raw_file(path, fmt, block_bytes=64))  # tiny blocks: several per file
    columns = {k: sum((b.columns[k].to_pylist() for b in blocks), []) for k in blocks[0].columns}
    labels = None if blocks[0].labels is None else np.concatenate([b.labels for b in blocks])
    return columns, labels, [b.first_line for b in blocks]


def test_inputs_are_the_feature_columns_and_zero_width_tensors_are_left_out():
    movies = schema(MOVIES)
    assert raw_inputs(movies) == ("price", "userId", "genres")
    assert model_inputs(movies) == ("dense", "sparse")
    assert model_inputs(schema({**MOVIES, "dense": []}, dense=())) == ("sparse",)
    assert model_inputs(schema({**MOVIES, "categorical": [], "multi_hot": {}}, categorical=(), multi_hot=())) == (
        "dense",)


def test_csv_with_header_quotes_and_unnamed_columns(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('timestamp,userId,genres,price,liked\n'
                    '17,u1,Action|Comedy,9.99,1\n'
                    '18,"u,2","Drama",,0\n'  # a quoted delimiter; a missing price
                    '19,u3,"Sci-Fi\nWestern",3,\n'  # a quoted line break; no label
                    + "".join(f"{20 + i},u{i},,1,1\n" for i in range(20)))
    columns, labels, firsts = read_all(path, raw_format(schema(MOVIES)))
    assert list(columns) == ["price", "userId", "genres"]  # timestamp: not an input
    assert columns["userId"][:3] == ["u1", "u,2", "u3"] and columns["genres"][:3] == ["Action|Comedy", "Drama",
                                                                                        "Sci-Fi\nWestern"]
    assert columns["price"][:3] == ["9.99", "", "3"] and len(columns["price"]) == 23
    assert labels[:2].tolist() == [1.0, 0.0] and np.isnan(labels[2]) and labels[3:].tolist() == [1.0] * 20
    assert firsts[0] == 2 and len(firsts) > 1  # rows start on line 2, after the header


def test_headerless_gzip_tsv_with_or_without_its_label(tmp_path):
    described = {**MOVIES, "format": "tsv", "header": False, "delimiter": "\t", "quote": None,
                 "columns": ["liked", "price", "userId", "genres"]}
    fmt = raw_format(schema(described))
    full, test = tmp_path / "full.tsv.gz", tmp_path / "test.tsv"
    full.write_bytes(gzip.compress(b"1\t2.5\tu1\tA|B\n0\t\tu2\t\n"))
    test.write_bytes(b"2.5\tu1\tA|B\n")
    columns, labels, _ = read_all(full, fmt)
    assert columns == {"price": ["2.5", ""], "userId": ["u1", "u2"], "genres": ["A|B", ""]}
    assert labels.tolist() == [1.0, 0.0]
    columns, labels, _ = read_all(test, fmt)
    assert columns["genres"] == ["A|B"] and labels is None


def test_a_schema_without_a_format_reads_the_built_in_criteo_layout(tmp_path):
    criteo = schema({}, dense=("I1", "I2"), categorical=("C1",), multi_hot=())
    fmt = raw_format(criteo)
    assert (fmt.format, fmt.header, fmt.delimiter, fmt.quote, fmt.columns) == ("tsv", False, "\t", None,
                                                                               ("label", "I1", "I2", "C1"))
    path = tmp_path / "day.tsv"
    path.write_text('0\t5\t\t"a\n1\t-1\t3\t68fd1e64\n')  # a quote is data in the raw Criteo TSV
    columns, labels, _ = read_all(path, fmt)
    assert columns == {"I1": ["5", "-1"], "I2": ["", "3"], "C1": ['"a', "68fd1e64"]} and labels.tolist() == [0, 1]


def test_parquet_lists_become_separated_text_and_numbers_their_text(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"userId": pa.array([7, 8, None]), "price": pa.array([2.5, None, 3.0]),
                             "genres": pa.array([["A", "B"], [], None]), "liked": pa.array([True, False, None])}),
                   path)
    columns, labels, _ = read_all(path, raw_format(schema({**MOVIES, "format": "parquet"})))
    assert columns == {"price": ["2.5", "", "3"], "userId": ["7", "8", ""], "genres": ["A|B", "", ""]}
    assert labels[:2].tolist() == [1.0, 0.0] and np.isnan(labels[2])


def test_malformed_files_name_the_line(tmp_path):
    fmt = raw_format(schema(MOVIES))
    short = tmp_path / "short.csv"
    short.write_text("userId,genres,price,liked\n" + "u1,A,1,0\n" * 30 + "u2,A\n")
    with pytest.raises(UserError, match=r"short.csv: line 32: expected 4 fields, found 2"):
        read_all(short, fmt)
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"userId,genres,price,liked\nu1,A,1,0\nu\xe9,A,1,0\n")
    with pytest.raises(UserError, match=r"latin.csv: line 3: field 1: not UTF-8"):
        read_all(latin, fmt)
    label = tmp_path / "label.csv"
    label.write_text("userId,genres,price,liked\nu1,A,1,0\nu1,A,1,yes\n")
    with pytest.raises(UserError, match=r"label.csv: line 3: label 'yes' is not 0 or 1"):
        read_all(label, fmt)
    header = tmp_path / "header.csv"
    header.write_text("user,genres,price,liked\nu1,A,1,0\n")
    with pytest.raises(UserError, match=r"header.csv: line 1: the header has no column 'userId'"):
        read_all(header, fmt)
    with pytest.raises(UserError, match=r"nowhere.csv: cannot read"):
        read_all(tmp_path / "nowhere.csv", fmt)
