"""The hidden teacher that labels synthetic rows, and the exact AUC of its probabilities.

The teacher is a random factorization machine over the features a model sees after preprocessing:
a bias and a latent vector per category value among the `HEAD_RANKS` most popular of its column
(shrinking with rank), one for a missing value, and a weight and a latent vector per dense feature
`log1p(max(x, 0))`. A multi-hot field (a bag of values, e.g. a movie's genres) adds the rows of
every value in the bag, so the pairwise term also pairs each of them with every other field.
Rarer values carry no effect, so what decides a label is learnable from a few hundred thousand
rows. Its logit is quantized to a grid of 1/`GRID` so that the AUC per day is counted exactly from
two histograms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

HEAD_RANKS = 1024  # per column, values past this popularity rank get no teacher effect
FACTORS = 4  # latent size of the pairwise (FM) term
GRID = 1024  # logit quantization steps per unit
LIMIT = 16  # logits are clipped to [-LIMIT, LIMIT]
CODES = 2 * LIMIT * GRID + 1  # number of distinct quantized logits


@dataclass(frozen=True)
class Teacher:
    """A random FM: `offset + lin_scale * linear + pair_scale * pairwise`, logits quantized."""

    # per categorical column float32 [K+2, 2 + FACTORS]: columns bias, latent vector, its squared norm;
    # rows: K head ranks, K = every rarer value (all zero), K+1 = missing
    tables: tuple[np.ndarray, ...]
    dense_table: np.ndarray  # [13, 2 + FACTORS], laid out as `tables`, per unit of standardized log count
    dense_mu: np.ndarray  # [13] centring of log1p(max(x, 0))
    dense_sd: np.ndarray  # [13]
    lin_scale: float = 1.0
    pair_scale: float = 1.0
    offset: float = 0.0
    bag_tables: tuple[np.ndarray, ...] = ()  # per multi-hot field, laid out as `tables`

    def parts(self, dense: np.ndarray, items: np.ndarray,
              bags: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Linear and pairwise scores, float64 [B] each.

        dense: [B, n_dense] raw numbers, missing already 0; items: int64 [B, n_tables] popularity
        ranks, -1 = missing; bags: per `bag_tables` entry, int64 [B, L] ranks, -1 = padding (a bag
        of padding only is a missing value).
        """
        z = (np.log1p(np.maximum(dense, 0).astype(np.float64)) - self.dense_mu) / self.dense_sd
        total = np.zeros((len(z), self.dense_table.shape[1]))  # [B, 2 + FACTORS], columns as in `tables`
        for j, row in enumerate(self.dense_table):  # elementwise, not BLAS: the same bits on every machine
            total[:, :-1] += z[:, j, None] * row[:-1]
            total[:, -1] += z[:, j] * z[:, j] * row[-1]
        total = total.astype(np.float32)
        heads = np.array([len(table) - 2 for table in self.tables])
        rows = np.where(items < 0, heads + 1, np.minimum(items, heads))  # [B, 26] row in each table
        for col, table in enumerate(self.tables):
            total += table[rows[:, col]]
        for table, ranks in zip(self.bag_tables, bags):
            head = len(table) - 2
            present = ranks >= 0
            for slot in range(ranks.shape[1]):  # padding takes row `head`, which is all zero
                total += table[np.where(present[:, slot], np.minimum(ranks[:, slot], head), head)]
            total[~present.any(axis=1)] += table[head + 1]
        summed = total[:, 1:-1].astype(np.float64)
        pairwise = 0.5 * ((summed * summed).sum(axis=1) - total[:, -1])
        return total[:, 0].astype(np.float64), pairwise

    def codes(self, dense: np.ndarray, items: np.ndarray, bags: Sequence[np.ndarray] = ()) -> np.ndarray:
        """Quantized logits as int32 codes in [0, CODES): logit = code / GRID - LIMIT."""
        linear, pairwise = self.parts(dense, items, bags)
        return logit_codes(self.offset + self.lin_scale * linear + self.pair_scale * pairwise)


def logit_codes(logits: np.ndarray) -> np.ndarray:
    """Round logits onto the teacher's grid: int32 codes in [0, CODES)."""
    clipped = np.clip(logits, -LIMIT, LIMIT)
    return (np.rint(clipped * GRID) + LIMIT * GRID).astype(np.int32)


def code_probabilities() -> np.ndarray:
    """Probability of a click for every code, float64 [CODES]."""
    logits = np.arange(CODES, dtype=np.float64) / GRID - LIMIT
    return 1.0 / (1.0 + np.exp(-logits))


def build_teacher(seed: int, cardinalities: list[int], dense_mu, dense_sd,
                  rng: np.random.Generator | None = None) -> Teacher:
    """Draw a random teacher; effects shrink with a value's popularity rank (rare values matter less).
    Each column's weight comes from the seed; the tables from `rng` if given (a drifting day's fresh
    draw: the same scales), else from the seed's stream after the weights."""
    weights = np.random.default_rng([seed, 0x7EAC4E5])
    col_weight = weights.uniform(0.3, 1.0, size=len(cardinalities))
    rng = weights if rng is None else rng
    tables = [draw_table(rng, weight, card) for weight, card in zip(col_weight, cardinalities)]
    n_dense = len(dense_mu)
    dense_table = fm_table(rng.standard_normal(n_dense) * 0.6, rng.standard_normal((n_dense, FACTORS)) * 0.4)
    return Teacher(tables=tuple(tables), dense_table=dense_table,
                   dense_mu=np.asarray(dense_mu, dtype=np.float64), dense_sd=np.asarray(dense_sd, dtype=np.float64))


def draw_table(rng: np.random.Generator, weight: float, size: int, head: int = HEAD_RANKS) -> np.ndarray:
    """One field's float32 [k+2, 2 + FACTORS] table over a universe of `size` values ranked by
    popularity (k = min(size, head)): effects scaled by `weight` and shrinking with rank; row k
    (every rarer value) is zero, row k+1 is the missing value's."""
    k = min(size, head)
    decay = np.concatenate([(1.0 + np.arange(k) / 16.0) ** -0.5, [0.0, 1.0]])  # rarer values 0, missing 1
    bias = rng.standard_normal(k + 2) * weight * decay
    latent = rng.standard_normal((k + 2, FACTORS)) * (0.5 * weight * decay)[:, None]
    return fm_table(bias, latent).astype(np.float32)


def fm_table(bias: np.ndarray, latent: np.ndarray) -> np.ndarray:
    """Rows [bias, latent..., |latent|^2]: one gather per field gives all three FM sums."""
    return np.concatenate([bias[:, None], latent, (latent * latent).sum(1, keepdims=True)], axis=1)


def histogram_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC from positive/negative weights per code (ascending score); ties count one half."""
    neg_below = np.cumsum(neg) - neg
    total = float(pos.sum()) * float(neg.sum())
    if total == 0:
        return float("nan")
    return float(np.sum(pos * (neg_below + 0.5 * neg)) / total)


def calibrate(teacher: Teacher, dense: np.ndarray, items: np.ndarray, target_auc: float,
              target_ctr: float, pair_share: float = 0.35, bags: Sequence[np.ndarray] = ()) -> Teacher:
    """Scale the teacher so its expected AUC and mean click rate on a sample hit the targets.

    `pair_share` is the pairwise term's standard deviation relative to the linear term's.
    """
    linear, pairwise = teacher.parts(dense, items, bags)
    lin_sd, pair_sd = linear.std() or 1.0, pairwise.std() or 1.0
    score = (linear - linear.mean()) / lin_sd + pair_share * (pairwise - pairwise.mean()) / pair_sd
    probs = code_probabilities()

    def fit_offset(alpha: float) -> tuple[float, np.ndarray]:
        """The offset giving the target click rate at this scale, and the probabilities it gives."""
        lo, hi = -LIMIT, LIMIT
        for _ in range(24):  # mean probability increases with the offset
            mid = 0.5 * (lo + hi)
            p = probs[logit_codes(mid + alpha * score)]
            lo, hi = (mid, hi) if p.mean() < target_ctr else (lo, mid)
        return mid, p

    lo, hi = 0.0, 8.0
    for _ in range(20):  # expected AUC increases with the scale
        alpha = 0.5 * (lo + hi)
        offset, p = fit_offset(alpha)
        codes = logit_codes(offset + alpha * score)
        auc = histogram_auc(np.bincount(codes, p, CODES), np.bincount(codes, 1.0 - p, CODES))
        lo, hi = (alpha, hi) if auc < target_auc else (lo, alpha)
    offset -= alpha * (linear.mean() / lin_sd + pair_share * pairwise.mean() / pair_sd)
    return replace(teacher, lin_scale=alpha / lin_sd, pair_scale=alpha * pair_share / pair_sd, offset=offset)


def recenter(teacher: Teacher, dense: np.ndarray, items: np.ndarray, target_ctr: float,
             bags: Sequence[np.ndarray] = ()) -> Teacher:
    """The teacher with its offset set so its mean click probability on a sample is `target_ctr`, its
    scales kept (a drifted teacher's mean logit wanders with its tables)."""
    linear, pairwise = teacher.parts(dense, items, bags)
    score = teacher.lin_scale * linear + teacher.pair_scale * pairwise
    probs, lo, hi = code_probabilities(), -2.0 * LIMIT, 2.0 * LIMIT
    for _ in range(40):  # mean probability increases with the offset
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if probs[logit_codes(mid + score)].mean() < target_ctr else (lo, mid)
    return replace(teacher, offset=0.5 * (lo + hi))


class AucCounter:
    """Counts sampled labels per teacher code, so the AUC over any number of chunks is exact."""

    def __init__(self) -> None:
        self.pos = np.zeros(CODES, dtype=np.int64)
        self.neg = np.zeros(CODES, dtype=np.int64)

    def update(self, codes: np.ndarray, labels: np.ndarray) -> None:
        """Add one chunk: codes int32 [B], labels 0/1 [B]."""
        clicked = labels.astype(bool)
        self.pos += np.bincount(codes[clicked], minlength=CODES)
        self.neg += np.bincount(codes[~clicked], minlength=CODES)

    def auc(self) -> float:
        """Exact AUC of the teacher's probability against the labels counted so far."""
        return histogram_auc(self.pos.astype(np.float64), self.neg.astype(np.float64))

    def ctr(self) -> float:
        """Fraction of counted rows labelled 1."""
        total = int(self.pos.sum() + self.neg.sum())
        return float(self.pos.sum()) / total if total else float("nan")
