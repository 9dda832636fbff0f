"""Exact ranking and probability metrics over a whole split: AUC, logloss, calibration, and the
output-bias shift that calibrates a model's mean prediction on it (training's validation, `ctrflow
evaluate` and `ctrflow predict` read them).

Everything is vectorized numpy in O(n log n) (one sort); no sampling, no histogram
approximation, so two runs on the same predictions agree to the last digit.
"""

from __future__ import annotations

import numpy as np

LOGLOSS_EPS = 1e-15  # clip so that a prediction of exactly 0 or 1 gives a finite loss


def _check(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels ({labels.size}) and scores ({scores.size}) differ in length")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    if not np.isin(labels, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    return labels, scores


def _score_groups(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct scores in ascending order with the positives and negatives at each one."""
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    sorted_labels = labels[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    pos = np.add.reduceat(sorted_labels, starts) if starts.size else np.zeros(0)
    counts = np.diff(np.r_[starts, sorted_scores.size])
    return sorted_scores[starts], pos, counts - pos


def auc(labels, scores) -> float:
    """Exact area under the ROC curve; tied scores count half (the Mann-Whitney statistic).

    `labels` are 0/1, `scores` any monotone score (logits or probabilities). Returns NaN
    when the labels hold a single class, where AUC is undefined. The positives' and negatives'
    scores are sorted apart, in their own dtype (no float64 copy of a 178 M-row day), and each
    positive counts the negatives below and tied with it by binary search: integer counts, exact.
    """
    labels, scores = _check_lean(labels, scores)
    positive = labels == 1
    pos, neg = np.sort(scores[positive]), np.sort(scores[~positive])
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    below = np.searchsorted(neg, pos, side="left")  # [positives] negatives with a strictly lower score
    ties = np.searchsorted(neg, pos, side="right") - below
    wins = float(below.sum(dtype=np.int64)) + 0.5 * float(ties.sum(dtype=np.int64))
    return float(wins / (float(pos.size) * float(neg.size)))


def _check_lean(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    """As `_check`, without widening float32 inputs to float64."""
    labels, scores = np.asarray(labels).reshape(-1), np.asarray(scores).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels ({labels.size}) and scores ({scores.size}) differ in length")
    if scores.dtype.kind not in "fiu":
        scores = scores.astype(np.float64)
    if scores.dtype.kind == "f" and np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError("labels must be 0 or 1")
    return labels, scores


def roc_curve(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    """False and true positive rates at every distinct threshold, from (0, 0) to (1, 1)."""
    labels, scores = _check(labels, scores)
    _, pos, neg = _score_groups(labels, scores)
    # walk thresholds from the highest score down
    tp = np.r_[0.0, np.cumsum(pos[::-1])]
    fp = np.r_[0.0, np.cumsum(neg[::-1])]
    return fp / max(fp[-1], 1.0), tp / max(tp[-1], 1.0)


def logloss(labels, probabilities, eps: float = LOGLOSS_EPS) -> float:
    """Mean binary cross-entropy (natural log) of probabilities against 0/1 labels."""
    labels, probs = _check(labels, probabilities)
    if labels.size == 0:
        return float("nan")
    probs = np.clip(probs, eps, 1.0 - eps)
    return float(-np.mean(labels * np.log(probs) + (1.0 - labels) * np.log1p(-probs)))


def calibration(labels, probabilities, bins: int = 10) -> dict:
    """Mean predicted vs observed CTR, their `ratio`, and a reliability table over equal-mass bins.

    Bins hold (nearly) the same number of rows, ordered by prediction: CTR predictions
    crowd near the base rate, so equal-width bins would leave most of them empty.
    `ece` (expected calibration error) is the row-weighted mean |predicted - observed| over the bins.
    """
    labels, probs = _check(labels, probabilities)
    n = labels.size
    if n == 0:
        return {"mean_prediction": float("nan"), "observed_ctr": float("nan"), "ratio": float("nan"),
                "ece": float("nan"), "bins": []}
    edges = np.unique(np.linspace(0, n, min(bins, n) + 1).round().astype(np.int64))
    # the k-th smallest predictions at the bin edges: O(n) selection instead of a sort of every row
    ranked = np.partition(probs, np.unique(np.r_[edges[:-1], edges[1:] - 1]))
    which = _bin_of_rows(probs, ranked, edges)
    rows = np.bincount(which, minlength=len(edges) - 1)
    predicted = np.bincount(which, weights=probs, minlength=len(edges) - 1) / rows
    observed = np.bincount(which, weights=labels, minlength=len(edges) - 1) / rows
    table = [{"rows": int(rows[k]), "min_prediction": float(ranked[lo]), "max_prediction": float(ranked[hi - 1]),
              "mean_prediction": float(predicted[k]), "observed_ctr": float(observed[k])}
             for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]
    ece = float(np.sum(rows / n * np.abs(predicted - observed)))
    mean_prediction, observed_ctr = float(probs.mean()), float(labels.mean())
    ratio = mean_prediction / observed_ctr if observed_ctr > 0 else float("nan")
    return {"mean_prediction": mean_prediction, "observed_ctr": observed_ctr, "ratio": ratio,
            "ece": ece, "bins": table}


def _bin_of_rows(probs: np.ndarray, ranked: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each row's bin [n] when rows are ranked by prediction, ties in row order (a stable sort's bins).

    `ranked` holds the sorted predictions at positions `edges` (np.partition). A row goes past
    interior edge e when its prediction is above ranked[e], or equal to it and among the tied rows
    a stable sort would place at e or after."""
    which = np.zeros(probs.size, np.int16)
    for e in edges[1:-1]:
        value = ranked[e]
        above = probs > value
        which += above
        ties = np.flatnonzero(probs == value)
        before = e - (probs.size - int(np.count_nonzero(above)) - ties.size)  # tied rows left below the edge
        which[ties[before:]] += 1
    return which


def calibrating_shift(labels, logits, iterations: int = 30) -> float:
    """The constant `d` for which the mean of sigmoid(logits + d) equals the labels' mean: the output
    bias change that minimizes the logloss with every other weight fixed (that loss's derivative in
    `d` is the mean prediction minus the observed rate). Newton's method on the 1-D convex problem,
    from the gap between the two rates' log-odds; 0.0 when the labels hold one class or no row."""
    labels, logits = _check(labels, logits)
    rate = float(labels.mean()) if labels.size else 0.0
    if not 0.0 < rate < 1.0:
        return 0.0
    mean = float(_sigmoid(logits).mean())
    shift = float(np.log(rate / (1 - rate)) - np.log(max(mean, 1e-12) / max(1 - mean, 1e-12)))
    for _ in range(iterations):
        p = _sigmoid(logits + shift)
        step = (float(p.mean()) - rate) / max(float((p * (1 - p)).mean()), 1e-12)
        shift -= float(np.clip(step, -1.0, 1.0))  # a bounded step: the loss is flat far from the optimum
        if abs(step) < 1e-9:
            break
    return shift


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)) in float64 without overflow."""
    return np.exp(-np.logaddexp(0.0, -z))
