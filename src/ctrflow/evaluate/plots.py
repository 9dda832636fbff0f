"""ROC and calibration (reliability) plots as PNG files, drawn headless."""

from __future__ import annotations

import os

import numpy as np

MAX_POINTS = 2000  # a ROC curve over millions of thresholds looks the same with 2,000 of them


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers, KFP pods or CI
    import matplotlib.pyplot as plt

    return plt


def plot_roc(fpr: np.ndarray, tpr: np.ndarray, auc: float, path: str | os.PathLike) -> None:
    """Draw a ROC curve with its AUC in the legend and the chance diagonal."""
    if fpr.size > MAX_POINTS:
        keep = np.unique(np.r_[np.linspace(0, fpr.size - 1, MAX_POINTS).astype(np.int64), fpr.size - 1])
        fpr, tpr = fpr[keep], tpr[keep]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ax.plot(fpr, tpr, label=f"model (AUC = {auc:.4f})")
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_calibration(table: dict, path: str | os.PathLike) -> None:
    """Draw observed CTR against mean prediction per bin of `metrics.calibration`'s table."""
    bins = table["bins"]
    predicted = [b["mean_prediction"] for b in bins]
    observed = [b["observed_ctr"] for b in bins]
    top = max([*predicted, *observed, 1e-3]) * 1.05
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ax.plot([0, top], [0, top], linestyle="--", color="grey", label="perfect calibration")
    ax.plot(predicted, observed, marker="o", label=f"model (ECE = {table['ece']:.4f})")
    ax.set(xlabel="mean predicted CTR", ylabel="observed CTR", xlim=(0, top), ylim=(0, top),
           title=f"calibration: predicted {table['mean_prediction']:.4f} vs observed {table['observed_ctr']:.4f}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
