"""Raw rows → model inputs for predict and serving: exactly what preprocessing wrote, for any dataset."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pytest

from ctrflow.contract.formats.raw import read_raw_rows
from ctrflow.errors import UserError
from ctrflow.ingest.run import preprocess
from ctrflow.contract.transform import description_of, transform_raw
from ctrflow.contract.vocab import Vocabularies, load_vocabularies
from ctrflow.contract.schema import Schema
from tests.fixtures.tables import movie_rows, read_split, write_csv, write_description, write_parquet


@pytest.fixture
def movies(tmp_path):
    """A processed movies dataset and the raw columns it came from."""
    rows = movie_rows(300, seed=21)
    rows["price"][:4] = [" 2.5 ", "1e3", "+4", "-7.25"]  # the number grammar, and a negative
    data = write_csv(tmp_path / "m.csv", rows)
    out = tmp_path / "out"
    preprocess([data], out=out, dataset=write_description(tmp_path / "m.yaml"), workers=2, chunk_rows=90)
    return out, rows, data


def stacked(table: pa.Table, schema: Schema) -> tuple[np.ndarray, np.ndarray]:
    dense = np.stack([table.column(f.name).to_numpy() for f in schema.features.dense], axis=1)
    sparse = [np.asarray(table.column(f.name).to_pylist(), dtype=np.int32).reshape(len(table), -1)
              for f in schema.features.sparse]
    return dense, np.concatenate(sparse, axis=1)


def test_transform_raw_gives_the_floats_and_ids_preprocessing_wrote(movies):
    out, rows, _ = movies
    schema, vocab = Schema.load(out), load_vocabularies(out)
    dense, sparse = transform_raw({c: rows[c] for c in ("year", "price", "userId", "movieId", "genres")},
                                  schema, vocab)
    assert dense.dtype == np.float32 and sparse.dtype == np.int32 and sparse.shape == (300, 2 + 3)
    expected_dense, expected_sparse = stacked(read_split(out), schema)
    assert np.array_equal(dense, expected_dense) and np.array_equal(sparse, expected_sparse)
    as_bytes = {c: np.array([v.encode() for v in rows[c]], dtype=object) for c in ("year", "price", "userId",
                                                                                   "movieId", "genres")}
    assert np.array_equal(transform_raw(as_bytes, schema, vocab)[1], sparse)  # Triton sends BYTES
    unseen = transform_raw({"year": [""], "price": [None], "userId": ["nobody"], "movieId": [""],
                            "genres": ["Western||Drama|Drama|Comedy|Action"]}, schema, vocab)
    genre_ids = dict(zip(pq_values(out, "genres"), range(2, 100)))
    assert unseen[0].tolist() == [[0.0, 0.0]]  # missing dense: 0 (then log1p(0) = 0)
    assert unseen[1].tolist() == [[1, 0, 1, genre_ids["Drama"], genre_ids["Drama"]]]  # OOV, missing, Western OOV


def pq_values(out, name):
    import pyarrow.parquet as pq

    return pq.read_table(out / "vocab" / f"{name}.parquet").column("value").to_pylist()


def test_bad_raw_values_name_field_and_row(movies):
    out, rows, _ = movies
    schema, vocab = Schema.load(out), load_vocabularies(out)
    columns = {c: list(rows[c][:5]) for c in ("year", "price", "userId", "movieId", "genres")}
    columns["price"][3] = "cheap"
    with pytest.raises(UserError, match=r"field price, row 3: not a number: 'cheap'"):
        transform_raw(columns, schema, vocab)
    columns["price"][3] = "nan"
    with pytest.raises(UserError, match=r"field price, row 3: not a finite number"):
        transform_raw(columns, schema, vocab)
    del columns["genres"]
    with pytest.raises(UserError, match="missing input field"):
        transform_raw(columns, schema, vocab)


def test_the_raw_reader_feeds_transform_raw_for_csv_gzip_and_parquet(movies, tmp_path):
    out, rows, data = movies
    schema, vocab = Schema.load(out), load_vocabularies(out)
    expected = stacked(read_split(out), schema)
    labels = np.array([float(v) for v in rows["liked"]], dtype=np.float32)
    gz = tmp_path / "m.csv.gz"
    gz.write_bytes(gzip.compress((tmp_path / "m.csv").read_bytes()))
    sources = {"csv": (data, description_of(schema)), "gzip": (str(gz), description_of(schema))}
    rows["price"][:4] = ["2.5", "1000", "4", "-7.25"]  # Parquet holds the numbers themselves
    parquet = write_parquet(tmp_path / "m.parquet", rows, row_group_size=64)
    sources["parquet"] = (parquet, _as_parquet(schema.dataset))
    for kind, (path, described) in sources.items():
        blocks = list(read_raw_rows(path, described, block_bytes=4096))
        assert len(blocks) > 1 or kind == "parquet"
        got = [transform_raw(b.columns, schema, vocab) for b in blocks]
        assert np.array_equal(np.concatenate([g[0] for g in got]), expected[0]), kind
        assert np.array_equal(np.concatenate([g[1] for g in got]), expected[1]), kind
        assert np.array_equal(np.concatenate([b.labels for b in blocks]), labels), kind


def _as_parquet(raw: dict):
    """The same description, reading Parquet."""
    from ctrflow.contract.description import Description

    kept = {k: v for k, v in raw.items() if k not in ("header", "delimiter", "quote", "columns")}
    return Description.from_dict({**kept, "format": "parquet"})


def test_the_raw_reader_reads_files_without_the_label_and_names_bad_lines(movies, tmp_path):
    out, rows, _ = movies
    schema = Schema.load(out)
    unlabelled = {c: v for c, v in rows.items() if c != "liked"}
    path = write_csv(tmp_path / "new.csv", unlabelled)
    blocks = list(read_raw_rows(path, description_of(schema)))
    assert all(b.labels is None for b in blocks) and sum(len(b.columns["userId"]) for b in blocks) == 300
    text = (tmp_path / "new.csv").read_text().splitlines()
    text[6] = "u1,5,Drama,19x9,1.0,t"  # a year that is no number, line 7
    (tmp_path / "new.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(UserError, match=r"new.csv: line 7: column year: not a number: '19x9'"):
        list(read_raw_rows(path, description_of(schema)))


def test_criteo_serving_still_equals_criteo_preprocessing(tmp_path):
    from tests.fixtures.preprocess import random_rows, row, write

    from ctrflow.contract.criteo import DENSE, SPARSE

    lines = random_rows(200, seed=4) + [row("0", {"I2": "-7", "I9": "123456789012"}, {"C5": "odd value"})] * 3
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", lines)], out=out, freq_threshold=2, workers=1)
    fields = [line.split("\t") for line in lines]
    columns = {c: [f[1 + j] for f in fields] for j, c in enumerate((*DENSE, *SPARSE))}
    schema = Schema.load(out)
    dense, sparse = transform_raw(columns, schema, Vocabularies.load(out, schema))
    expected = stacked(read_split(out), schema)
    assert np.array_equal(dense, expected[0]) and np.array_equal(sparse, expected[1])
    blocks = list(read_raw_rows(tmp_path / "in.tsv", description_of(schema)))
    assert np.array_equal(np.concatenate([transform_raw(b.columns, schema, load_vocabularies(out))[0]
                                          for b in blocks]), dense)
    test_layout = tmp_path / "test.tsv"
    test_layout.write_text("".join(line.split("\t", 1)[1] + "\n" for line in lines))
    unlabelled = list(read_raw_rows(test_layout, description_of(schema)))
    assert unlabelled[0].labels is None
    columns["I4"][7] = "3.5"
    with pytest.raises(UserError, match=r"field I4, row 7: not an integer: '3.5'"):
        transform_raw(columns, schema, load_vocabularies(out))
