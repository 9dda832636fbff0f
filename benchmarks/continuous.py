"""Continuous training on drifting days against a frozen model and daily retraining from scratch.

`ctrflow synth --dataset movielens-like --drift F` writes days 0..D (users and movies renew, the teacher's
tastes move). Day 0 trains the first model (preprocess day 0, valid day 1). Then on each day k = 1..D-1:
- continuous: `preprocess --vocab-from` the previous day's data (train day k, valid day k+1), then
  `train --init-from` the previous day's checkpoint, one epoch on day k;
- frozen: the day-0 model, scoring day k+1 read through day 0's vocabulary;
- scratch: a new model trained on days 0..k (one epoch, the same architecture), its vocabulary from them.
Each is scored (AUC, `ctrflow evaluate`) on day k+1, which none trained on. Training seconds are the
`train` calls' wall time: reading the data, building (and warm-starting) the model, the steps, the
checkpoint, and a token validation of one batch (the full scoring of day k+1 is not training); their
CPU seconds (the process's, all threads) beside it, steadier on a shared machine. The checkpoint delta
is what changed between the continuous model of day k-1 and of day k, read off the two checkpoints:
embedding rows that differ (new rows included), each with an 8-byte id, and the dense weights, in
fp32 bytes against the whole model's.

Command (from the repo root): `PYTHONPATH=src nice -n 10 python benchmarks/continuous.py --out DIR`
[--rows 200000 --days 6 --drift 0.1 --model dlrm --threads 1 --tracking-uri URI]. Prints one JSON line
(and one short line per day as it goes); writes DIR/continuous.json and DIR/continuous.png; with
--tracking-uri, logs both, and the figures per day, to MLflow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from ctrflow.checkpoint import read_meta, resolve_checkpoint
from ctrflow.checkpoint.tables import read_model_state
from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.synth.movielens import synthesize
from ctrflow.evaluate import evaluate
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from ctrflow.train.loop import train

TARGETS = {"vs_scratch": -0.002, "time_share": 1 / 3, "vs_frozen_last": 0.01}


def parse(argv=None) -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="work directory (data, checkpoints, results)")
    p.add_argument("--rows", type=int, default=200_000, help="rows per day")
    p.add_argument("--days", type=int, default=6, help="days trained (0..days-1); day `days` is only scored")
    p.add_argument("--drift", type=float, default=0.1, help="synth --drift: share of values new per day")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="dlrm")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training")
    p.add_argument("--workers", type=int, default=2, help="preprocess workers")
    p.add_argument("--tracking-uri", default=None, help="log the results to this MLflow tracking URI")
    return p.parse_args(argv)


class Run:
    """The steps of the benchmark on one work directory, their output kept in `log`."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.work = args, Path(args.out)
        self.raw = self.work / "raw"
        self.log = self.work / "steps.log"

    def day(self, k: int) -> str:
        """Day k's CSV."""
        return str(self.raw / f"day_{k}.csv")

    def quiet(self):
        """Steps print a lot: into the log."""
        return contextlib.redirect_stdout(open(self.log, "a"))

    def prep(self, name: str, train_days: list[int], valid_day: int, vocab_from: Path | None = None) -> Path:
        """Preprocess days `train_days` (valid: `valid_day`) into work/data/name."""
        out = self.work / "data" / name
        with self.quiet():
            preprocess([self.day(k) for k in train_days], [self.day(valid_day)], out,
                       dataset=str(self.raw / "movielens.yaml"), workers=self.args.workers, vocab_from=vocab_from)
        return out

    def fit(self, data: Path, name: str, init_from: Path | None = None) -> tuple[float, dict, Path]:
        """(AUC on the valid split, {"seconds", "cpu_seconds"} of training, checkpoint) of one epoch on `data`."""
        a = self.args
        config = TrainConfig(out=str(self.work / "ckpt" / name), data=DataConfig(path=str(data),
                             batch_size=a.batch_size, limit_eval_batches=1),
                             model=ModelConfig(name=a.model, embedding_dim=16),
                             optim=OptimConfig(lr=1e-3, sparse_lr=0.01), epochs=1, seed=a.seed, threads=a.threads,
                             progress=False, log_every=0, device="cpu", overwrite=True)
        config = replace(config, init_from=str(init_from) if init_from else None)
        started, cpu = time.perf_counter(), time.process_time()
        with self.quiet():
            train(config)
        cost = {"seconds": round(time.perf_counter() - started, 2), "cpu_seconds": round(time.process_time() - cpu, 2)}
        return self.score(data, Path(config.out), name), cost, Path(config.out)

    def score(self, data: Path, ckpt: Path, name: str) -> float:
        """AUC of `ckpt` on `data`'s valid split."""
        with self.quiet():
            return evaluate(data, ckpt, self.work / "eval" / name, threads=self.args.workers)["auc"]


def checkpoint_delta(before: Path, after: Path) -> dict:
    """What changed from checkpoint `before` to `after`: embedding rows (differing or new, with an 8-byte
    id each) and dense weights, in bytes, against the whole model's fp32 bytes."""
    states = []
    for ckpt in (before, after):
        step = resolve_checkpoint(ckpt)
        states.append(read_model_state(step, read_meta(step, verify=False)))
    old, new = states
    rows = changed = table_bytes = changed_bytes = 0
    for name in new["tables"]:
        a, b = old["tables"][name], new["tables"][name]
        moved = int((b[:a.shape[0]] != a).any(dim=1).sum()) + b.shape[0] - a.shape[0]
        rows, changed = rows + b.shape[0], changed + moved
        table_bytes += b.shape[0] * b.shape[1] * 4
        changed_bytes += moved * (b.shape[1] * 4 + 8)
    dense = sum(t.numel() * 4 for t in new["dense"].values() if torch.is_tensor(t) and t.is_floating_point())
    changed_bytes += dense
    return {"rows": rows, "changed_rows": changed, "changed_rows_share": round(changed / rows, 4),
            "changed_bytes": changed_bytes, "model_bytes": table_bytes + dense,
            "bytes_share": round(changed_bytes / (table_bytes + dense), 4)}


def run(args: argparse.Namespace) -> dict:
    """Every step; the results (per day and totals)."""
    r = Run(args)
    r.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    teacher = synthesize(r.raw, args.rows, args.days + 1, args.seed, drift=args.drift)["teacher_auc"]
    first = r.prep("c0", [0], 1)
    auc0, cost0, ckpt0 = r.fit(first, "c0")
    days = [{"day": 0, "scored_on": 1, "continuous": auc0, "frozen": auc0, "scratch": auc0,
             "continuous_train": cost0, "scratch_train": cost0, "cardinalities": Schema.load(first).cardinalities}]
    data, ckpt = first, ckpt0
    for k in range(1, args.days):
        grown = r.prep(f"c{k}", [k], k + 1, vocab_from=data)
        auc, cost, new_ckpt = r.fit(grown, f"c{k}", init_from=ckpt)
        frozen = r.score(r.prep(f"f{k}", [0], k + 1), ckpt0, f"f{k}")  # day k+1 read through day 0's vocabulary
        scratch_auc, scratch_cost, _ = r.fit(r.prep(f"s{k}", list(range(k + 1)), k + 1), f"s{k}")
        days.append({"day": k, "scored_on": k + 1, "continuous": auc, "frozen": frozen, "scratch": scratch_auc,
                     "continuous_train": cost, "scratch_train": scratch_cost,
                     "cardinalities": Schema.load(grown).cardinalities,
                     "checkpoint_delta": checkpoint_delta(ckpt, new_ckpt)})
        data, ckpt = grown, new_ckpt
        print(json.dumps({"day": k, **{key: round(days[-1][key], 4) for key in ("continuous", "frozen", "scratch")}}),
              flush=True)
    for d in days:  # the ceiling: the synthetic teacher's own AUC on the day scored
        d["teacher"] = teacher[f"day_{d['scored_on']}"]
    return summarize(args, days, (load_before, os.getloadavg()[0]))


def summarize(args: argparse.Namespace, days: list[dict], load: tuple[float, float]) -> dict:
    """The JSON line: per day, totals and the targets met or not."""
    later = days[1:]
    totals = {key: {side: round(sum(d[f"{side}_train"][key] for d in later), 1) for side in ("continuous", "scratch")}
              for key in ("seconds", "cpu_seconds")}
    for total in totals.values():
        total["ratio"] = round(total["continuous"] / total["scratch"], 3)
    checks = {"continuous >= scratch - 0.002 every day": all(d["continuous"] >= d["scratch"] + TARGETS["vs_scratch"]
                                                              for d in later),
              "continuous seconds <= scratch / 3 (wall)": totals["seconds"]["ratio"] <= TARGETS["time_share"],
              "continuous seconds <= scratch / 3 (CPU)": totals["cpu_seconds"]["ratio"] <= TARGETS["time_share"],
              "continuous >= frozen + 0.01 on the last day": later[-1]["continuous"] >= later[-1]["frozen"]
              + TARGETS["vs_frozen_last"]}
    return {"benchmark": "continuous", "dataset": "movielens-like", "rows_per_day": args.rows, "days_trained": args.days,
            "drift": args.drift, "seed": args.seed, "model": args.model, "batch_size": args.batch_size,
            "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average_1m": [round(x, 1) for x in load], "days": days, "train": totals,
            "targets": checks, "met": all(checks.values())}


def plot(result: dict, path: Path) -> None:
    """AUC per day per strategy, and training seconds per day."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = result["days"]
    scored = [d["scored_on"] for d in days]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("continuous", "o-"), ("scratch", "s--"), ("frozen", "x:")):
        left.plot(scored, [d[key] for d in days], style, label=key)
    if "teacher" in days[0]:
        left.plot(scored, [d["teacher"] for d in days], "-", color="gray", linewidth=0.8, label="teacher (ceiling)")
    left.set(xlabel="day scored (trained through the day before)", ylabel="AUC", title="AUC on the next day")
    left.legend()
    later = days[1:]
    x = [d["day"] for d in later]
    for side, offset in (("continuous", -0.2), ("scratch", 0.2)):
        right.bar([i + offset for i in x], [d[f"{side}_train"]["seconds"] for d in later], 0.4,
                  label=f"{side}{' (days 0..k)' if side == 'scratch' else ''}: wall")
        right.plot([i + offset for i in x], [d[f"{side}_train"]["cpu_seconds"] for d in later], "k_", markersize=14,
                   label="CPU seconds" if side == "continuous" else None)
    right.set(xlabel="day trained", ylabel="training seconds", title="Training time per day")
    right.legend()
    fig.suptitle(f"{result['model']}, {result['rows_per_day']:,} rows a day, drift {result['drift']}: "
                 f"continuous / scratch training seconds {result['train']['seconds']['ratio']} (wall), "
                 f"{result['train']['cpu_seconds']['ratio']} (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def track(result: dict, work: Path, uri: str) -> None:
    """Log the results to MLflow: params, per-day AUCs and seconds (step = day), the JSON and the plot."""
    from ctrflow.tracking import make_tracker

    with make_tracker(uri, "ctrflow-benchmarks", run_name="continuous") as tracker:
        tracker.log_params({k: result[k] for k in ("dataset", "rows_per_day", "days_trained", "drift", "seed", "model",
                                                   "batch_size", "threads", "machine")})
        for d in result["days"]:
            metrics = {f"auc_{k}": d[k] for k in ("continuous", "frozen", "scratch")}
            metrics.update(continuous_seconds=d["continuous_train"]["seconds"],
                           scratch_seconds=d["scratch_train"]["seconds"])
            if "checkpoint_delta" in d:
                metrics.update(delta_bytes=d["checkpoint_delta"]["changed_bytes"],
                               delta_bytes_share=d["checkpoint_delta"]["bytes_share"],
                               changed_rows_share=d["checkpoint_delta"]["changed_rows_share"])
            tracker.log_metrics(metrics, step=d["day"])
        tracker.log_metrics({"seconds_ratio": result["train"]["seconds"]["ratio"],
                             "cpu_seconds_ratio": result["train"]["cpu_seconds"]["ratio"],
                             "targets_met": float(result["met"])})
        tracker.log_artifact(work / "continuous.json")
        tracker.log_artifact(work / "continuous.png")


def main(argv=None) -> int:
    """Run, write the JSON and the plot, print the JSON line, log to MLflow if asked."""
    args = parse(argv)
    result = run(args)
    work = Path(args.out)
    (work / "continuous.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, work / "continuous.png")
    if args.tracking_uri:
        track(result, work, args.tracking_uri)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
