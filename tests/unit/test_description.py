"""Dataset descriptions: the documented format, and one-line errors before any data is read."""

from __future__ import annotations

import json

import pytest

from ctrflow.cli import main
from ctrflow.contract.catalog import describe
from ctrflow.contract.criteo import DENSE, RAW_COLUMNS, SPARSE
from ctrflow.contract.description import Description, load_description
from ctrflow.errors import UserError
from ctrflow.ingest.run import preprocess
from tests.fixtures.tables import movie_rows, write_csv, write_description

EXAMPLE = """\
format: csv              # csv | tsv | parquet
header: true
delimiter: ","
label: liked
dense: [year, price]
categorical: [userId, movieId]
multi_hot:
  genres: {separator: "|", max_length: 10, pooling: sum}
freq_threshold: {default: 6, userId: 2}
"""


def test_the_documented_example_reads_and_round_trips(tmp_path):
    path = tmp_path / "movies.yaml"
    path.write_text(EXAMPLE)
    described = load_description(path)
    assert described.name == "movies" and described.sparse == ("userId", "movieId", "genres")
    assert described.threshold("userId") == 2 and described.threshold("movieId") == 6
    assert described.multi_hot["genres"].max_length == 10 and described.transform("price") == "log1p"
    features = described.features({"userId": 5, "movieId": 7, "genres": 9})
    assert [(f.name, f.kind, f.width) for f in features.sparse] == [("userId", "categorical", 1),
                                                                    ("movieId", "categorical", 1),
                                                                    ("genres", "multi_hot", 10)]
    again = Description.from_dict(json.loads(json.dumps(described.to_dict())))
    assert again.to_dict() == described.to_dict()
    as_json = tmp_path / "movies.json"
    as_json.write_text(json.dumps(described.to_dict()))
    assert load_description(as_json).to_dict() == described.to_dict()


def test_the_built_in_criteo_description_names_its_columns():
    criteo = describe("criteo")
    assert criteo.to_dict()["name"] == "criteo" and criteo.columns == RAW_COLUMNS
    assert criteo.dense == DENSE and criteo.categorical == SPARSE and criteo.dense_type == "integer"
    assert criteo.format == "tsv" and not criteo.header and criteo.quote is None


@pytest.mark.parametrize("change, message", [
    ("colour: red", "unknown key 'colour'"),
    ("dense: [year, userId]", "column 'userId' is both dense and categorical"),
    ("dense: [liked]", "column 'liked' is both label and dense"),
    ("format: xlsx", "format: must be one of csv, tsv, parquet"),
    ("multi_hot: {genres: {max_length: 0}}", "multi_hot: genres: max_length must be a positive integer"),
    ("multi_hot: {genres: {max_length: 3, pooling: max}}", "pooling must be one of sum, mean"),
    ("multi_hot: {genres: {max_length: 3, width: 2}}", "multi_hot: genres: unknown key 'width'"),
    ("freq_threshold: {default: 2, title: 3}", "freq_threshold: 'title' is not a sparse column"),
    ("freq_threshold: 0", "freq_threshold: must be a positive integer"),
    ("transform: {price: sqrt}", "transform: price: must be one of log1p, none"),
    ("header: false", "columns: required with header: false"),
    ("delimiter: ';;'", "delimiter: must be one character"),
])
def test_a_bad_description_is_a_one_line_error_naming_key_and_file(tmp_path, change, message):
    path = tmp_path / "bad.yaml"
    key = change.split(":")[0]
    kept = "\n".join(line for line in EXAMPLE.splitlines() if not line.startswith(key) and
                     not (key == "multi_hot" and line.startswith("  genres")))
    path.write_text(kept + "\n" + change + "\n")
    with pytest.raises(UserError, match=message) as caught:
        load_description(path)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)


def test_a_column_missing_from_the_header_stops_before_any_row_is_read(tmp_path, capsys):
    rows = movie_rows(50)
    rows.pop("price")
    data = write_csv(tmp_path / "movies.csv", rows)
    with open(data, "a") as f:
        f.write("garbage that would fail to parse\n")
    described = write_description(tmp_path / "movies.yaml")
    code = main(["preprocess", "--dataset", described, "--train", data, "--out", str(tmp_path / "out"),
                 "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "column 'price' (dense) is not in" in err and "movies.csv's header" in err and described in err
    assert not (tmp_path / "out").exists()


def test_unreadable_descriptions_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("format: [csv\n")
    with pytest.raises(UserError, match="broken.yaml: not valid YAML"):
        load_description(broken)
    with pytest.raises(UserError, match="no such dataset description file"):
        preprocess(["x.csv"], out=tmp_path / "o", dataset=str(tmp_path / "absent.yaml"))
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="a dataset description is a mapping"):
        load_description(listed)
