"""Drifting synthetic days (`ctrflow synth --drift F`): new category values every day, and a teacher
whose tastes move, so that training day after day can be measured against a frozen model.

Day 0 is the undrifted world. On each later day d, with share F:
- new values: every popularity slot of a categorical field (a user, a movie; a Criteo column's rank)
  is taken by a new value with probability F, decided by a hash of (seed, field, slot, d): the old
  value stops appearing, the new one (its generation g + 1) keeps the slot's popularity. About a share
  F of the values (and of the rows' values) is new each day, compounding over days;
- the teacher moves: each row of its tables (every field's bias and latent vector, the multi-hot bags',
  the dense features') becomes sqrt(1 - F) * yesterday's + sqrt(F) * a fresh draw of the same scale,
  so its variance, and the teacher's AUC, hold; a slot taken by a new value gets a fresh row outright.
With F = 0 nothing of this runs: the same bytes as without `--drift`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ctrflow.synth.teacher import Teacher, fm_table
from ctrflow.errors import UserError

DRIFT_KEY = 0xD21F7
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & MASK64
    return x ^ (x >> np.uint64(31))


def check_drift(share: float) -> None:
    """`--drift` must be a share in [0, 1)."""
    if not 0.0 <= share < 1.0:
        raise UserError(f"--drift must be in [0, 1) (a share of values new each day), got {share}")


@dataclass(frozen=True)
class Drift:
    """The drift of a seed's days: `share` F of values new per day, the teacher moving by F per day."""

    share: float
    seed: int

    def _uniform(self, field: int, slots: np.ndarray, day: int) -> np.ndarray:
        """A uniform in [0, 1) per slot, fixed by (seed, field, slot, day)."""
        key = mix64(np.array([((self.seed * 1_000_003 + field) * 1_000_003 + day * 7919 + DRIFT_KEY) % (1 << 64)],
                             np.uint64))
        with np.errstate(over="ignore"):
            bits = mix64(slots.astype(np.uint64) ^ key[0])
        return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def renewed(self, field: int, slots: np.ndarray, day: int) -> np.ndarray:
        """bool per slot: taken by a new value on `day` (never on day 0)."""
        if day == 0 or self.share <= 0:
            return np.zeros(len(slots), dtype=bool)
        return self._uniform(field, slots, day) < self.share

    def generations(self, field: int, slots: np.ndarray, day: int) -> np.ndarray:
        """int64 per slot: how many new values have taken it by `day` (0 for a missing slot, -1)."""
        gen = np.zeros(len(slots), dtype=np.int64)
        present = slots >= 0
        for d in range(1, day + 1):
            gen[present] += self.renewed(field, slots[present], d)
        return gen

    def rng(self, day: int) -> np.random.Generator:
        """The random stream of the day's fresh teacher draws."""
        return np.random.default_rng([self.seed, day, DRIFT_KEY])

    def move(self, teacher: Teacher, fresh: Teacher, day: int) -> Teacher:
        """The teacher of `day` from the day before's (`teacher`): every table row moved toward `fresh`
        (a draw of the same shapes and scales, uncalibrated), the rows of renewed head slots replaced."""
        keep, new = math.sqrt(1.0 - self.share), math.sqrt(self.share)

        def moved(old: np.ndarray, draw: np.ndarray) -> np.ndarray:
            mixed = keep * old[:, :-1].astype(np.float64) + new * draw[:, :-1]
            return fm_table(mixed[:, 0], mixed[:, 1:]).astype(old.dtype)

        tables = []
        for field, (old, draw) in enumerate(zip(teacher.tables, fresh.tables)):
            table, head = moved(old, draw), len(old) - 2
            renewed = np.flatnonzero(self.renewed(field, np.arange(head), day))
            table[renewed] = draw[renewed].astype(old.dtype)
            tables.append(table)
        return replace(teacher, tables=tuple(tables), dense_table=moved(teacher.dense_table, fresh.dense_table),
                       bag_tables=tuple(moved(o, d) for o, d in zip(teacher.bag_tables, fresh.bag_tables)))

    def record(self) -> dict:
        """What synth.json records of the drift."""
        return {"share": self.share, "new_values": f"each slot of a categorical field taken by a new value with "
                                                   f"probability {self.share} per day after day 0",
                "teacher": f"table rows = sqrt(1 - {self.share}) * yesterday's + sqrt({self.share}) * fresh, "
                           "per day after day 0"}
