"""Synthetic movielens-like day files whose labels come from a hidden teacher.

The world is drawn once per seed: `USERS` users and `ITEMS` movies, each with a popularity rank
(Zipf-Mandelbrot, `p(rank) ~ (rank + q) ** -s`), an id (a seeded permutation of 1..N), and per
movie 0-4 genres (common genres more often), an age in years and a price. A row draws a user and a
movie by popularity; 5% of rows lose their price. The teacher is a factorization machine over
what a model sees after preprocessing (user, movie, the genre bag, log1p of age and price), so a
user's taste for genres and movies is a learnable pairwise effect.

Rows are drawn in chunks of `CHUNK_ROWS`, each from its own random stream: the same (rows, days,
seed, drift) give the same bytes. `--drift F` (`ctrflow.synth.drift`): from day 1 on, users and movies
are replaced by new ones (new ids: the slot's day-0 id + generation * universe; a new movie keeps its
slot's genres, age and price) and the teacher's tastes move, each by a share F a day.
"""

from __future__ import annotations

import gzip as gzip_lib
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from ctrflow.contract.movielens import (COLUMNS, DESCRIPTION_FILE, GENRE_NAMES, MAX_GENRES, NAME,
                                                    SEPARATOR, description_text)
from ctrflow.synth.drift import Drift
from ctrflow.synth.report import open_out, track, write_atomic
from ctrflow.synth.teacher import (AucCounter, Teacher, calibrate, code_probabilities, draw_table, fm_table,
                                      recenter)

VERSION = 1
CHUNK_ROWS = 1 << 16
CALIBRATION_ROWS = 1 << 15
TARGET_AUC = 0.80
TARGET_CTR = 0.35  # share of impressions liked
USERS = (20_000, 1.0, 8.0)  # universe, Zipf s, q
ITEMS = (4_000, 1.1, 4.0)
GENRE_WEIGHTS = 1.0 / (np.arange(len(GENRE_NAMES)) + 2.0)  # Drama most common, Film-Noir rarest
GENRE_COUNTS = (0.02, 0.40, 0.33, 0.17, 0.08)  # share of movies with 0..4 genres
MISSING_PRICE = 0.05
FIELD_WEIGHTS = {"user": 1.0, "item": 1.0, "genres": 0.8}  # teacher effect scale per field
DENSE_WEIGHT = 0.6
START = 1_767_225_600  # 2026-01-01 00:00:00 UTC: day d's timestamps fall on day d after it


def zipf_ranks(u: np.ndarray, universe: tuple[int, float, float]) -> np.ndarray:
    """Popularity ranks in [0, size) from uniforms: the exact discrete Zipf-Mandelbrot inverse CDF."""
    size, s, q = universe
    cdf = np.cumsum((np.arange(size) + q) ** -s)
    return np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), size - 1)


class World:
    """The seed's users and movies: ids by popularity rank, and each movie's genres, age and price."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 0x4D0F1E])
        self.user_ids = rng.permutation(USERS[0]) + 1  # rank -> userId
        self.item_ids = rng.permutation(ITEMS[0]) + 1  # rank -> movieId
        n = ITEMS[0]
        counts = rng.choice(len(GENRE_COUNTS), size=n, p=GENRE_COUNTS)
        # weighted draws without replacement, all movies at once: the largest log(weight) + Gumbel noise
        keys = np.log(GENRE_WEIGHTS) + rng.gumbel(size=(n, len(GENRE_NAMES)))
        order = np.argsort(-keys, axis=1, kind="stable")[:, :MAX_GENRES]
        self.genres = np.where(np.arange(MAX_GENRES) < counts[:, None], order, -1)  # genre indices, -1 = padding
        self.genre_text = pa.array([SEPARATOR.join(GENRE_NAMES[g] for g in row if g >= 0) or None
                                    for row in self.genres.tolist()], pa.string())
        self.age = np.minimum(np.floor(rng.exponential(12.0, n)), 80).astype(np.int64)
        base = 2.99 + 12.0 * np.exp(-self.age / 8.0) + rng.normal(0.0, 1.5, n)
        self.price = np.round(np.clip(np.floor(base) + 0.99, 0.99, 24.99), 2)


def sample_rows(rng: np.random.Generator, n: int, world: World) -> dict[str, np.ndarray]:
    """One chunk: popularity ranks of user and movie, the movie's features, a missing-price mask."""
    users = zipf_ranks(rng.random(n), USERS)
    items = zipf_ranks(rng.random(n), ITEMS)
    price_missing = rng.random(n) < MISSING_PRICE
    price = np.where(price_missing, 0.0, world.price[items])
    return {"users": users, "items": items, "genres": world.genres[items], "age": world.age[items],
            "price": price, "price_missing": price_missing}


def teacher_inputs(rows: dict[str, np.ndarray]):
    """(dense [n, 2], ranks [n, 2], bags) as `Teacher.parts` takes them."""
    dense = np.stack([rows["age"].astype(np.float64), rows["price"]], axis=1)
    return dense, np.stack([rows["users"], rows["items"]], axis=1), (rows["genres"],)


def draw_teacher(rng: np.random.Generator, dense_mu=np.zeros(2), dense_sd=np.ones(2)) -> Teacher:
    """An uncalibrated teacher: user and movie tables, the genre bag's, the dense features', in that order
    from `rng` (a drifting day's fresh draw has the same shapes and scales)."""
    tables = (draw_table(rng, FIELD_WEIGHTS["user"], USERS[0]), draw_table(rng, FIELD_WEIGHTS["item"], ITEMS[0]))
    bag = draw_table(rng, FIELD_WEIGHTS["genres"], len(GENRE_NAMES))
    dense_table = fm_table(rng.standard_normal(2) * DENSE_WEIGHT, rng.standard_normal((2, 4)) * 0.4 * DENSE_WEIGHT)
    return Teacher(tables=tables, dense_table=dense_table, dense_mu=dense_mu, dense_sd=dense_sd, bag_tables=(bag,))


def make_teacher(seed: int, world: World, target_ctr: float = TARGET_CTR) -> Teacher:
    """The seed's teacher, scaled on a calibration sample to AUC ~0.80 and like rate `target_ctr`."""
    sample = sample_rows(np.random.default_rng([seed, 1 << 20]), CALIBRATION_ROWS, world)
    dense, ranks, bags = teacher_inputs(sample)
    logs = np.log1p(dense)
    teacher = draw_teacher(np.random.default_rng([seed, 0x7EAC4E6]), logs.mean(axis=0), logs.std(axis=0) + 1e-9)
    return calibrate(teacher, dense, ranks, target_auc=TARGET_AUC, target_ctr=target_ctr, bags=bags)


def chunk_table(rng: np.random.Generator, rows: dict[str, np.ndarray], labels: np.ndarray, world: World,
                day: int, start: int, total: int, drift: Drift | None = None) -> pa.Table:
    """The CSV columns of one chunk (missing values are nulls: empty fields)."""
    n = len(labels)
    # timestamps rise through the day: row i of `total` sits at i/total of it, plus jitter
    seconds = ((np.arange(start, start + n) + rng.random(n)) * (86_400 / total)).astype(np.int64)
    users, items = world.user_ids[rows["users"]], world.item_ids[rows["items"]]
    if drift is not None:  # a slot's g-th new value: its day-0 id + g * universe (distinct from every other)
        users = users + drift.generations(0, rows["users"], day) * USERS[0]
        items = items + drift.generations(1, rows["items"], day) * ITEMS[0]
    arrays = [pa.array(users), pa.array(items),
              world.genre_text.take(pa.array(rows["items"])), pa.array(rows["age"]),
              pa.array(rows["price"], mask=rows["price_missing"]), pa.array(START + day * 86_400 + seconds),
              pa.array(labels.astype(np.int8))]
    return pa.Table.from_arrays(arrays, names=list(COLUMNS))


def write_day(path: Path, rows: int, day: int, seed: int, world: World, teacher: Teacher,
              gzip: bool, drift: Drift | None = None) -> AucCounter:
    """Write one day file atomically (header, then the rows); returns the exact label counts per code.
    `teacher`: the day's (moved by `drift`, whose new users and movies the rows get)."""
    probs, counter = code_probabilities(), AucCounter()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            # filename="" and mtime=0 keep the gzip header free of names and times: same seed, same bytes
            sink = gzip_lib.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) if gzip else raw
            sink.write((",".join(COLUMNS) + "\n").encode())  # pyarrow would quote the names
            for start in range(0, rows, CHUNK_ROWS):
                rng = np.random.default_rng([seed, day, start // CHUNK_ROWS, 0x4D4C])
                sample = sample_rows(rng, min(CHUNK_ROWS, rows - start), world)
                codes = teacher.codes(*teacher_inputs(sample))
                labels = rng.random(len(codes)) < probs[codes]
                counter.update(codes, labels)
                # quoting "none": no value holds a comma, a quote or a line break
                options = pa_csv.WriteOptions(include_header=False, quoting_style="none")
                pa_csv.write_csv(chunk_table(rng, sample, labels, world, day, start, rows, drift), sink, options)
            if gzip:
                sink.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return counter


def synthesize(out, rows: int, days: int, seed: int, gzip: bool = False, tracker=None, drift: float = 0.0,
               click_rate: float | None = None) -> dict:
    """Write `out/day_{d}.csv[.gz]` for d < days (`rows` rows each), `out/movielens.yaml` (their
    dataset description) and `out/synth.json`; returns synth.json's content. `drift`: the share F of
    users and movies new each day and of the teacher's move (`ctrflow.synth.drift`; 0: none). `click_rate`:
    the teacher's mean like probability (None: `TARGET_CTR`)."""
    out = open_out(out, rows, days, seed, drift)
    started = time.perf_counter()
    world = World(seed)
    target_ctr = TARGET_CTR if click_rate is None else click_rate
    teacher = make_teacher(seed, world, target_ctr)
    report = {"version": VERSION, "dataset": NAME, "description": DESCRIPTION_FILE, "rows": rows, "days": days,
              "seed": seed, "gzip": gzip, "files": [], "teacher_auc": {}, "ctr": {}}
    drifting = Drift(drift, seed) if drift else None
    if drifting is not None:
        report["drift"] = drifting.record()
    for day in range(days):
        path = out / f"day_{day}.csv{'.gz' if gzip else ''}"
        if drifting is not None and day:  # the day's tastes, at the same like rate
            teacher = drifting.move(teacher, draw_teacher(drifting.rng(day)), day)
            sample = sample_rows(np.random.default_rng([seed, 1 << 20]), CALIBRATION_ROWS, world)
            dense, ranks, bags = teacher_inputs(sample)
            teacher = recenter(teacher, dense, ranks, target_ctr, bags)
        counter = write_day(path, rows, day, seed, world, teacher, gzip, drifting)
        report["files"].append({"path": path.name, "rows": rows, "bytes": path.stat().st_size})
        report["teacher_auc"][f"day_{day}"] = round(counter.auc(), 6)
        report["ctr"][f"day_{day}"] = round(counter.ctr(), 6)
    write_atomic(out / DESCRIPTION_FILE, description_text())
    report["params"] = synth_params(teacher, target_ctr)
    write_atomic(out / "synth.json", json.dumps(report, indent=2) + "\n")
    seconds = time.perf_counter() - started
    if tracker is not None:
        params = {"dataset": NAME, "rows": rows, "days": days, "seed": seed, "gzip": gzip, "drift": drift,
                  "click_rate": target_ctr}
        track(tracker, params, report, seconds, [out / "synth.json", out / DESCRIPTION_FILE])
    return {**report, "seconds": seconds}


def synth_params(teacher: Teacher, target_ctr: float) -> dict:
    """What generated the data, for `synth.json` (the teacher's tables stay hidden)."""
    return {
        "chunk_rows": CHUNK_ROWS,
        "users": dict(zip(("universe", "zipf_s", "zipf_q"), USERS)),
        "items": dict(zip(("universe", "zipf_s", "zipf_q"), ITEMS)),
        "genres": list(GENRE_NAMES), "genre_counts": list(GENRE_COUNTS), "missing_price": MISSING_PRICE,
        "teacher": {"kind": "factorization machine", "target_auc": TARGET_AUC, "target_ctr": target_ctr,
                    "lin_scale": teacher.lin_scale, "pair_scale": teacher.pair_scale, "offset": teacher.offset},
    }
