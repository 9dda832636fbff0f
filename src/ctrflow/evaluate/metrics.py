"""Exact ranking and probability metrics over a whole split: AUC, logloss, calibration.

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
    when the labels hold a single class, where AUC is undefined.
    """
    labels, scores = _check(labels, scores)
    _, pos, neg = _score_groups(labels, scores)
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    neg_below = np.cumsum(neg) - neg  # negatives with a strictly lower score
    wins = np.dot(pos, neg_below + 0.5 * neg)
    return float(wins / (n_pos * n_neg))


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
    """Mean predicted vs observed CTR, and a reliability table over equal-count bins.

    Bins hold (nearly) the same number of rows, ordered by prediction: CTR predictions
    crowd near the base rate, so equal-width bins would leave most of them empty.
    `ece` is the row-weighted mean |predicted - observed| over the bins.
    """
    labels, probs = _check(labels, probabilities)
    n = labels.size
    if n == 0:
        return {"mean_prediction": float("nan"), "observed_ctr": float("nan"), "ratio": float("nan"),
                "ece": float("nan"), "bins": []}
    order = np.argsort(probs, kind="stable")
    edges = np.unique(np.linspace(0, n, min(bins, n) + 1).round().astype(np.int64))
    table, ece = [], 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        idx = order[lo:hi]
        predicted, observed = float(probs[idx].mean()), float(labels[idx].mean())
        ece += (hi - lo) / n * abs(predicted - observed)
        table.append({"rows": int(hi - lo), "min_prediction": float(probs[idx[0]]),
                      "max_prediction": float(probs[idx[-1]]),
                      "mean_prediction": predicted, "observed_ctr": observed})
    mean_prediction, observed_ctr = float(probs.mean()), float(labels.mean())
    ratio = mean_prediction / observed_ctr if observed_ctr > 0 else float("nan")
    return {"mean_prediction": mean_prediction, "observed_ctr": observed_ctr, "ratio": ratio,
            "ece": float(ece), "bins": table}
