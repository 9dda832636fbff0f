"""The movielens-like files' columns and their dataset description (`movielens.yaml`).

A row is one impression of a movie to a user:

    userId,movieId,genres,age,price,timestamp,liked
    1187,302,Comedy|Romance,12,4.99,1767225731,1

`genres` is a "|"-separated list (empty: none listed), `age` the movie's age in years, `price` in
dollars (empty: unknown), `timestamp` seconds since the epoch (not a model input: the description
leaves it out), `liked` the 0/1 label.
"""

from __future__ import annotations

from typing import Any

NAME = "movielens-like"  # `ctrflow synth --dataset NAME`
DESCRIPTION_FILE = "movielens.yaml"  # written beside the day files
USER, ITEM, GENRES, AGE, PRICE, TIMESTAMP, LABEL = "userId", "movieId", "genres", "age", "price", "timestamp", "liked"
COLUMNS = (USER, ITEM, GENRES, AGE, PRICE, TIMESTAMP, LABEL)  # the CSV header, in order
SEPARATOR = "|"
MAX_GENRES = 4  # genres per movie at most: the multi-hot feature's max_length (nothing is truncated)

GENRE_NAMES = ("Drama", "Comedy", "Thriller", "Action", "Romance", "Adventure", "Crime", "Sci-Fi", "Horror",
               "Fantasy", "Children", "Animation", "Mystery", "Documentary", "War", "Musical", "Western",
               "Film-Noir")  # most common first


def description() -> dict[str, Any]:
    """The dataset description of the files, as a dict (the same content as `description_text`)."""
    return {
        "format": "csv",
        "header": True,
        "delimiter": ",",
        "label": LABEL,
        "dense": [AGE, PRICE],
        "categorical": [USER, ITEM],
        "multi_hot": {GENRES: {"separator": SEPARATOR, "max_length": MAX_GENRES, "pooling": "sum"}},
        "freq_threshold": {"default": 2},
    }


def description_text() -> str:
    """`movielens.yaml`: the description with a comment per line (YAML, written without a YAML library)."""
    return f"""\
# Dataset description of the movielens-like files written by `ctrflow synth --dataset {NAME}`.
# Use it with: ctrflow preprocess --dataset {DESCRIPTION_FILE} --train day_0.csv --valid day_1.csv --out DIR
format: csv
header: true                  # the first line names the columns
delimiter: ","
label: {LABEL}                   # 1 = the user liked the movie
dense: [{AGE}, {PRICE}]           # years since release; dollars (empty = unknown -> 0); log1p
categorical: [{USER}, {ITEM}]
multi_hot:
  {GENRES}: {{separator: "{SEPARATOR}", max_length: {MAX_GENRES}, pooling: sum}}   # empty = no genre listed
freq_threshold: {{default: 2}}   # {TIMESTAMP} is not named: not a model input
"""
