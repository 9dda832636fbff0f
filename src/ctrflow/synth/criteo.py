"""Synthetic Criteo-format day files whose labels come from a hidden teacher (`ctrflow synth`).

Columns are calibrated on the real sample in `shared/data/criteo` (STATS.txt): missing rates, which
columns go missing together, the shape of the integer counts, and per categorical column a
Zipf-Mandelbrot popularity law `p(rank) ~ (rank + q) ** -s` over a universe of Criteo's (Kaggle)
cardinality, with `s, q` fitted so the top value's share and the distinct count in 10k rows match.
Distinct counts therefore grow with `rows` as in the real logs, and rare values exist at any size.

A value's 8 hex digits are a hash of (seed, column, popularity rank): the universe is the same
every day. Drift is mild: inside blocks of 4 ranks past the top 16 the popularity order is rotated
per day, and integer counts shift slightly upwards each day. `--drift F` (`ctrflow.synth.drift`)
adds more: from day 1 on, each rank's value is replaced by a new one (a hash of the rank and its
generation) and the teacher's tastes move, each by a share F a day.
"""

from __future__ import annotations

import gzip as gzip_lib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from ctrflow.contract.criteo import DENSE, RAW_COLUMNS, SPARSE
from ctrflow.contract.multihot import SEPARATOR, expand
from ctrflow.synth.drift import Drift, mix64
from ctrflow.synth.report import open_out, track, write_atomic
from ctrflow.synth.teacher import AucCounter, Teacher, build_teacher, calibrate, code_probabilities, recenter

VERSION = 1
CHUNK_ROWS = 1 << 16  # rows drawn per random stream; fixed, so bytes depend only on (rows, days, seed)
CALIBRATION_ROWS = 1 << 15  # day-0 rows the teacher is scaled on (their own random stream)
TARGET_AUC = 0.80  # the middle of [0.75, 0.85], real Criteo's range; a day's exact AUC lands within ~0.01 of it
TARGET_CTR = 0.23  # Criteo's click rate is 0.2-0.26

# (universe size, Zipf exponent s, offset q) per C1..C26. Universes are the Kaggle Criteo cardinalities
# except C6 and C22, whose 10k-row sample shows only 7 values (universe 8 then fits far better).
CATEGORICAL = (
    (1460, 1.978, 0.971), (583, 1.865, 6.182), (10131227, 1.033, 1.175), (2202608, 1.103, 1.250),
    (305, 2.665, 1.077), (8, 0.881, 0.046), (12517, 1.180, 26.233), (633, 2.309, 1.029),
    (3, 2.672, 0.454), (93145, 1.050, 0.049), (5683, 1.289, 17.142), (8351593, 1.047, 1.361),
    (3194, 1.285, 15.970), (27, 6.000, 10.472), (14992, 1.462, 24.913), (5461306, 1.082, 1.867),
    (10, 1.055, 0.320), (5652, 1.580, 10.899), (2173, 1.146, 0.008), (4, 0.520, 0.607),
    (7046547, 1.062, 1.574), (8, 3.029, 2.493), (15, 4.087, 4.751), (286181, 1.234, 2.624),
    (105, 5.644, 11.192), (142572, 1.148, 1.685),
)
# log1p(count) ~ Normal(mu, sd) floored to an integer, per I1..I13 (fitted to the sample's quantiles).
DENSE_MU = (0.70, 2.08, 2.40, 1.83, 7.04, 3.54, 1.51, 2.00, 3.64, 0.69, 1.10, 0.25, 2.04)
DENSE_SD = (1.29, 2.53, 1.20, 0.88, 2.77, 1.74, 1.56, 1.08, 1.59, 0.30, 0.95, 0.70, 0.99)
ACTIVITY = 0.5  # correlation of each count with a per-row activity level
I2_NEGATIVE = (0.0977, 0.006)  # share of I2 values that are negative; share of those that are -2
DENSE_DRIFT = 0.02  # per day, added to mu
# Columns that go missing together (one uniform per group and row) and their missing rate.
MISSING_GROUPS = (
    (("I1", "I10"), 0.4488), (("I3",), 0.2033), (("I4", "I13"), 0.1975), (("I5",), 0.0494),
    (("I6",), 0.2516), (("I7", "I9", "I11"), 0.0495), (("I8",), 0.0010), (("I12",), 0.7738),
    (("C3", "C4", "C12", "C16", "C21", "C24"), 0.0358), (("C6",), 0.1330),
    (("C19", "C20", "C25", "C26"), 0.4497), (("C22",), 0.8179),
)
HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), dtype=np.uint16)  # byte -> 2 hex digits


def sample_ranks(u: np.ndarray, size: int, s: float, q: float) -> np.ndarray:
    """Popularity ranks in [0, size) from uniforms: inverse CDF of the density (x + q) ** -s on [0, size)."""
    a = 1.0 - s
    lo, hi = q ** a, (size + q) ** a
    x = (lo + u * (hi - lo)) ** (1.0 / a) - q
    return np.minimum(x.astype(np.int64), size - 1)


def drift_ranks(ranks: np.ndarray, size: int, key: int, day: int) -> np.ndarray:
    """Rotate popularity inside blocks of 4 ranks (past the top 16) by a per-day, per-block amount."""
    block = (ranks >> 2).astype(np.uint64)
    shift = (mix64(block ^ np.uint64(key) ^ np.uint64(day * 0x51ED27)) & np.uint64(3)).astype(np.int64)
    rotated = (ranks & ~np.int64(3)) | ((ranks + shift) & 3)
    return np.where(ranks >= 16, np.minimum(rotated, size - 1), ranks)


def column_keys(seed: int) -> np.ndarray:
    """One 64-bit hash key per categorical column: value = hash(key, rank)."""
    return mix64(np.arange(len(SPARSE), dtype=np.uint64) + np.uint64(seed % (1 << 40)) * np.uint64(64))


def missing_mask(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Per column name, a bool [n] that marks missing fields."""
    mask = {}
    for names, rate in MISSING_GROUPS:
        missing = rng.random(n) < rate
        for name in names:
            mask[name] = missing
    return mask


def sample_features(rng: np.random.Generator, n: int, day: int, keys: np.ndarray):
    """One chunk of features: (dense int64 [n,13], dense missing bool [n,13], ranks int64 [n,26], -1 = missing)."""
    mask = missing_mask(rng, n)
    activity = rng.standard_normal(n)
    noise = rng.standard_normal((n, len(DENSE)))
    mu = np.asarray(DENSE_MU) + DENSE_DRIFT * day
    level = mu + np.asarray(DENSE_SD) * (ACTIVITY * activity[:, None] + np.sqrt(1 - ACTIVITY**2) * noise)
    dense = np.floor(np.expm1(np.clip(level, 0.0, 20.0))).astype(np.int64)
    u = rng.random(n)
    negative, minus_two = I2_NEGATIVE
    dense[:, 1] = np.where(u < negative, np.where(u < negative * minus_two, -2, -1), dense[:, 1])
    dense_missing = np.stack([mask.get(c, np.zeros(n, bool)) for c in DENSE], axis=1)
    dense[dense_missing] = 0
    ranks = np.empty((n, len(SPARSE)), dtype=np.int64)
    uniforms = rng.random((n, len(SPARSE)))
    for col, (size, s, q) in enumerate(CATEGORICAL):
        ranks[:, col] = drift_ranks(sample_ranks(uniforms[:, col], size, s, q), size, int(keys[col]), day)
        ranks[mask.get(SPARSE[col], np.zeros(n, bool)), col] = -1
    return dense, dense_missing, ranks


def hex_column(ranks: np.ndarray, key: int, generations: np.ndarray | None = None) -> pa.Array:
    """8 lowercase hex digits per rank (a hash of key and rank, and of the rank's generation under
    `--drift`: a new value in the slot); rank -1 becomes an empty field."""
    present = ranks >= 0
    slots = ranks[present].astype(np.uint64) ^ np.uint64(key)
    if generations is not None:  # generation 0 keeps the day-0 value
        gen = generations[present].astype(np.uint64)
        slots = slots ^ np.where(gen > 0, mix64(gen * np.uint64(0x9E37) + np.uint64(key)), np.uint64(0))
    hashed = (mix64(slots) >> np.uint64(32)).astype(np.uint32)
    data = HEX_PAIRS[hashed.astype(">u4").view(np.uint8)].tobytes()  # 4 bytes -> 4 pairs of hex digits
    offsets = np.zeros(len(ranks) + 1, dtype=np.int32)
    np.cumsum(present * 8, out=offsets[1:])
    return pa.StringArray.from_buffers(len(ranks), pa.py_buffer(offsets), pa.py_buffer(data))


def hex_lists(ranks: np.ndarray, length: int, size: int, key: int) -> pa.Array:
    """A multi-hot field per rank: the rank's value then `length - 1` more of the column's universe of
    `size` (`multihot.expand`), "|"-separated; rank -1 becomes an empty field (no values)."""
    present = ranks >= 0
    expanded = expand(ranks[present], length, 0, size, key)  # [m, length]
    tokens = np.frombuffer(hex_column(expanded.reshape(-1), key).buffers()[2], dtype=np.uint8)
    width = 9 * length - 1  # 8 hex digits a value, "|" between
    data = np.full((len(expanded), 9 * length), ord(SEPARATOR), dtype=np.uint8)
    data.reshape(len(expanded), length, 9)[:, :, :8] = tokens[:len(expanded) * length * 8].reshape(-1, length, 8)
    offsets = np.zeros(len(ranks) + 1, dtype=np.int32)
    np.cumsum(present * width, out=offsets[1:])
    return pa.StringArray.from_buffers(len(ranks), pa.py_buffer(offsets), pa.py_buffer(data[:, :width].tobytes()))


def chunk_table(labels, dense, dense_missing, ranks, keys, generations=None, hotness=None) -> pa.Table:
    """The 40 raw columns of one chunk; missing fields are nulls or empty strings (both write as empty).
    `generations`: [n, 26] of each value's slot under `--drift` (None: none). `hotness`: the values per
    field of each categorical column (None: one; more: a multi-hot field, `hex_lists`)."""
    arrays = [pa.array(labels.astype(np.int8))]
    arrays += [pa.array(dense[:, j], mask=dense_missing[:, j]) for j in range(len(DENSE))]
    arrays += [hex_column(ranks[:, c], int(keys[c]), None if generations is None else generations[:, c])
               if hotness is None or hotness[c] == 1 else
               hex_lists(ranks[:, c], hotness[c], CATEGORICAL[c][0], int(keys[c])) for c in range(len(SPARSE))]
    return pa.Table.from_arrays(arrays, names=list(RAW_COLUMNS))


def make_teacher(seed: int, target_ctr: float = TARGET_CTR) -> Teacher:
    """The seed's teacher, scaled on a calibration sample of day 0 to AUC ~0.80 and click rate `target_ctr`."""
    teacher = build_teacher(seed, [size for size, _, _ in CATEGORICAL], DENSE_MU, DENSE_SD)
    dense, _, ranks = sample_features(np.random.default_rng([seed, 1 << 20]), CALIBRATION_ROWS, 0, column_keys(seed))
    return calibrate(teacher, dense, ranks, target_auc=TARGET_AUC, target_ctr=target_ctr)


def write_day(path: Path, rows: int, day: int, seed: int, teacher: Teacher, gzip: bool,
              drift: Drift | None = None, hotness=None) -> AucCounter:
    """Write one day file atomically; returns the exact label counts per teacher code. `teacher`: the
    day's (moved by `drift`, whose new values the rows get).

    A writer thread formats and writes (and compresses) chunk k while this thread draws chunk k+1;
    at most two chunks are alive at once.
    """
    keys, probs, counter = column_keys(seed), code_probabilities(), AucCounter()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw, ThreadPoolExecutor(max_workers=1) as writer:
            # filename="" and mtime=0 keep the gzip header free of names and times: same seed, same bytes
            sink = gzip_lib.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) if gzip else raw
            pending = None
            for start in range(0, rows, CHUNK_ROWS):
                rng = np.random.default_rng([seed, day, start // CHUNK_ROWS])
                n = min(CHUNK_ROWS, rows - start)
                dense, dense_missing, ranks = sample_features(rng, n, day, keys)
                codes = teacher.codes(dense, ranks)
                labels = rng.random(n) < probs[codes]
                counter.update(codes, labels)
                generations = None if drift is None else \
                    np.stack([drift.generations(c, ranks[:, c], day) for c in range(len(SPARSE))], axis=1)
                if pending is not None:
                    pending.result()  # sync point: keeps chunks in order and memory at two chunks
                pending = writer.submit(write_chunk, sink, labels, dense, dense_missing, ranks, keys, generations,
                                        hotness)
            if pending is not None:
                pending.result()
            if gzip:
                sink.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return counter


def write_chunk(sink, labels, dense, dense_missing, ranks, keys, generations=None, hotness=None) -> None:
    """Format one chunk as tab-separated lines and append it to `sink`."""
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    pa_csv.write_csv(chunk_table(labels, dense, dense_missing, ranks, keys, generations, hotness), sink, options)


def synthesize(out, rows: int, days: int, seed: int, gzip: bool = False, tracker=None, drift: float = 0.0,
               hotness=None, click_rate: float | None = None) -> dict:
    """Write `out/day_{d}.tsv[.gz]` for d < days (`rows` rows each) and `out/synth.json`; returns its content.

    The files are raw Criteo format: label, I1..I13, C1..C26, tab-separated, empty = missing. `drift`:
    the share F of values new each day and of the teacher's move (`ctrflow.synth.drift`; 0: none).
    `hotness`: values per field of each categorical column (`chunk_table`; None: one each).
    `click_rate`: the teacher's mean click probability (None: `TARGET_CTR`).
    """
    out = open_out(out, rows, days, seed, drift)
    started = time.perf_counter()
    target_ctr = TARGET_CTR if click_rate is None else click_rate
    teacher = make_teacher(seed, target_ctr)
    report = {"version": VERSION, "rows": rows, "days": days, "seed": seed, "gzip": gzip,
              "files": [], "teacher_auc": {}, "ctr": {}}
    drifting = Drift(drift, seed) if drift else None
    if drifting is not None:
        report["drift"] = drifting.record()
    for day in range(days):
        path = out / f"day_{day}.tsv{'.gz' if gzip else ''}"
        if drifting is not None and day:
            fresh = build_teacher(seed, [size for size, _, _ in CATEGORICAL], DENSE_MU, DENSE_SD, drifting.rng(day))
            teacher = drifting.move(teacher, fresh, day)  # the day's tastes, at the same click rate
            dense, _, ranks = sample_features(np.random.default_rng([seed, 1 << 20]), CALIBRATION_ROWS, day,
                                              column_keys(seed))
            teacher = recenter(teacher, dense, ranks, target_ctr)
        counter = write_day(path, rows, day, seed, teacher, gzip, drifting, hotness)
        report["files"].append({"path": path.name, "rows": rows, "bytes": path.stat().st_size})
        report["teacher_auc"][f"day_{day}"] = round(counter.auc(), 6)
        report["ctr"][f"day_{day}"] = round(counter.ctr(), 6)
    report["params"] = synth_params(teacher, target_ctr)
    write_atomic(out / "synth.json", json.dumps(report, indent=2) + "\n")
    seconds = time.perf_counter() - started
    if tracker is not None:
        params = {"rows": rows, "days": days, "seed": seed, "gzip": gzip, "drift": drift, "click_rate": target_ctr}
        track(tracker, params, report, seconds, [out / "synth.json"])
    return {**report, "seconds": seconds}


def synth_params(teacher: Teacher, target_ctr: float) -> dict:
    """What generated the data, for `synth.json` (the teacher's tables stay hidden)."""
    return {
        "chunk_rows": CHUNK_ROWS,
        "categorical": {c: {"universe": n, "zipf_s": s, "zipf_q": q} for c, (n, s, q) in zip(SPARSE, CATEGORICAL)},
        "dense": {c: {"log1p_mu": m, "log1p_sd": d} for c, m, d in zip(DENSE, DENSE_MU, DENSE_SD)},
        "missing_groups": [{"columns": list(names), "rate": rate} for names, rate in MISSING_GROUPS],
        "i2_negative": I2_NEGATIVE[0],
        "dense_drift_per_day": DENSE_DRIFT,
        "teacher": {"kind": "factorization machine", "target_auc": TARGET_AUC, "target_ctr": target_ctr,
                    "lin_scale": teacher.lin_scale, "pair_scale": teacher.pair_scale, "offset": teacher.offset},
    }
