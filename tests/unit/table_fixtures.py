"""Small MovieLens-like tables (users, movies, a genre list, a year, a price, a 0/1 label) and their
description, written as CSV, TSV or Parquet into a test's temporary directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

GENRES = ["Action", "Comedy", "Drama", "Horror", "Sci-Fi", "Romance", "War"]
DESCRIPTION = {
    "format": "csv",
    "label": "liked",
    "dense": ["year", "price"],
    "categorical": ["userId", "movieId"],
    "multi_hot": {"genres": {"separator": "|", "max_length": 3, "pooling": "mean"}},
    "freq_threshold": {"default": 3, "userId": 2},
    "transform": {"default": "log1p", "year": "none"},
}


def movie_rows(n: int, seed: int = 0) -> dict[str, list]:
    """Columns of `n` rows: skewed user and movie ids, 0-5 genres (some lists longer than 3), an unused
    title holding the delimiter, a missing price now and then."""
    rng = np.random.default_rng(seed)
    users = [f"u{v}" for v in np.minimum(rng.zipf(1.5, n), 60)]
    movies = [str(v) for v in np.minimum(rng.zipf(1.4, n), 40)]
    genres = ["|".join(rng.choice(GENRES, rng.integers(0, 6), replace=False)) for _ in range(n)]
    price = [f"{p:.2f}" if rng.random() > 0.1 else "" for p in rng.gamma(2.0, 4.0, n)]
    return {"userId": users, "movieId": movies, "genres": genres,
            "year": [str(y) for y in rng.integers(1950, 2024, n)], "price": price,
            "title": [f"Movie {i}, part {i % 3}" for i in range(n)],
            "liked": [str(v) for v in (rng.random(n) < 0.3).astype(int)]}


def write_csv(path: Path, columns: dict[str, list], delimiter: str = ",") -> str:
    """A CSV (or TSV) with a header; values holding the delimiter or a quote are quoted."""
    names = list(columns)

    def field(value: str) -> str:
        if delimiter in value or '"' in value or "\n" in value:
            return '"' + value.replace('"', '""') + '"'
        return value

    lines = [delimiter.join(names)] + [delimiter.join(field(columns[c][i]) for c in names)
                                       for i in range(len(columns[names[0]]))]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def write_parquet(path: Path, columns: dict[str, list], row_group_size: int = 1000) -> str:
    """The same rows as Parquet: numbers typed, genres a list column, "" → null."""
    table = pa.table({
        "userId": pa.array(columns["userId"]),
        "movieId": pa.array([int(v) for v in columns["movieId"]], pa.int64()),
        "genres": pa.array([g.split("|") if g else [] for g in columns["genres"]], pa.list_(pa.string())),
        "year": pa.array([int(v) for v in columns["year"]], pa.int64()),
        "price": pa.array([float(v) if v else None for v in columns["price"]], pa.float64()),
        "title": pa.array(columns["title"]),
        "liked": pa.array([int(v) for v in columns["liked"]], pa.int8()),
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def write_description(path: Path, **changes) -> str:
    """The movies description (YAML), with `changes` applied (a value of None drops the key)."""
    raw = {**DESCRIPTION, **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    Path(path).write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def read_split(out: Path, split: str = "train") -> pa.Table:
    """All parts of a split, in part order."""
    parts = sorted((Path(out) / split).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else None
