"""Model quality against peer libraries: validation AUC per epoch of each model on the same data, and
the calibration of what each keeps (mean prediction / observed click rate).

    pip install -e ".[quality]"          # DeepCTR-Torch beside ctrflow (optional)
    PYTHONPATH=src python3 benchmarks/quality.py --work /tmp/quality [--epochs 2] [--threads 1]
        [--datasets criteo,movielens-like] [--models dlrm,dcnv2,deepfm,wide_deep] [--click-rate R]
        [--libraries ctrflow,deepctr-torch,fuxictr] [--peer-python PYTHON] [--ctrflow-args "..."]

Per dataset, `ctrflow synth --rows 200000 --days 2 --seed 0` (with `--dataset NAME` for any other
than criteo, and `--click-rate R` when given: rare clicks, e.g. 0.04) writes two days; `ctrflow
preprocess` with its defaults makes day 0 the train split and day 1 the valid split (`--data NAME=DIR`
takes a processed directory instead). A dataset the installed ctrflow cannot synthesize is reported as
skipped.

- ctrflow: each model trained by `ctrflow train` itself (its defaults; `--ctrflow-args` adds flags,
  e.g. `--config FILE`) for `--epochs` epochs; the loop validates on the whole valid split at each
  epoch's end, and the AUCs are read from the run's `metrics.jsonl`. `ctrflow evaluate` then scores
  the kept checkpoint: its calibration ratio, and the ratio of the bias training left (before the
  checkpoint's output bias was fitted on the valid split, `ctrflow.train.calibration`).
- DeepCTR-Torch (when importable by `--peer-python`, default this interpreter): DeepFM, WDL and DCN
  (full-rank "matrix" cross, 3 layers) on the *same processed ids and dense values* read from the
  Parquet splits: batch 2,048, embedding dim 16, MLP 128-64, Adam 1e-3, the library's other
  defaults (which include an L2 penalty of 1e-5 on embeddings and linear weights); one `fit` epoch
  at a time, then the valid split scored in order (the calibration ratio: the last epoch's).
- FuxiCTR: reported as skipped unless its package ships the architectures (2.3.10's package holds
  its layers and trainer, not its model zoo).

Every AUC is `ctrflow.metrics.auc` (exact) over the same valid rows. Prints one JSON line
(per library, model, dataset: AUC per epoch, best epoch, calibration ratio, seconds), then a table on
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODELS = ("dlrm", "dcnv2", "deepfm", "wide_deep")
LIBRARIES = ("ctrflow", "deepctr-torch", "fuxictr")
BATCH, DIM, MLP, LR = 2048, 16, (128, 64), 1e-3
REPO = Path(__file__).resolve().parent.parent
# DeepCTR-Torch's class for each ctrflow model, with the arguments that make it the same shape
DEEPCTR = {
    "deepfm": ("DeepFM", {}),
    "wide_deep": ("WDL", {}),
    "dcnv2": ("DCN", {"cross_num": 3, "cross_parameterization": "matrix"}),
}


def main(argv: list[str] | None = None) -> int:
    """Prepare each dataset, train every (library, model) on it, print the JSON line and the table."""
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(train_peer(args.worker, args.model, args.data_dir, args.epochs, args.threads, args.seed)))
        return 0
    work = Path(args.work)
    given = dict(item.split("=", 1) for item in args.data)
    results, skipped = [], []
    for dataset in args.datasets.split(","):
        data, reason = (given[dataset], None) if dataset in given else \
            prepare(dataset, work, args.rows, args.seed, args.click_rate)
        if data is None:
            skipped.append({"dataset": dataset, "reason": reason})
            continue
        for library in args.libraries.split(","):
            reason = peer_unavailable(library, args.peer_python)
            if reason:
                skipped.append({"library": library, "dataset": dataset, "reason": reason})
                continue
            for model in args.models.split(","):
                if library == "deepctr-torch" and model not in DEEPCTR:
                    continue  # no DLRM there
                row = run_one(library, model, dataset, data, work, args)
                results.append(row)
                print(f"{library:14s} {model:10s} {dataset:15s} auc {row.get('auc')} "
                      f"ratio {row.get('calibration_ratio')} ({row.get('seconds')} s)", file=sys.stderr, flush=True)
    report = {"benchmark": "quality", "machine": machine(), "epochs": args.epochs, "batch_size": BATCH,
              "embedding_dim": DIM, "mlp": list(MLP), "lr": LR, "seed": args.seed, "rows_per_day": args.rows,
              "click_rate": args.click_rate,
              "ctrflow_args": args.ctrflow_args, "results": results, "skipped": skipped}
    print(json.dumps(report))
    print(table(results, args.epochs), file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags (module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/ctrflow-quality", help="raw days, processed data and runs go here")
    p.add_argument("--datasets", default="criteo,movielens-like")
    p.add_argument("--data", action="append", default=[], metavar="NAME=DIR",
                   help="use this processed directory for dataset NAME (no synth, no preprocess)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--libraries", default=",".join(LIBRARIES))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000, help="synthetic rows per day")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic data and of every model")
    p.add_argument("--click-rate", type=float, default=None,
                   help="`ctrflow synth --click-rate` (default: each dataset's own rate)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each training")
    p.add_argument("--peer-python", default=sys.executable,
                   help="interpreter that has the peer libraries (default: this one)")
    p.add_argument("--ctrflow-args", default="", help="extra `ctrflow train` flags, one string")
    p.add_argument("--worker", choices=("deepctr-torch",), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prepare(dataset: str, work: Path, rows: int, seed: int,
            click_rate: float | None = None) -> tuple[str | None, str | None]:
    """(processed directory, None), or (None, why not): synth two days, preprocess with the defaults."""
    processed = work / dataset / "processed"
    if (processed / "schema.json").exists():
        return str(processed), None
    raw = work / dataset / "raw"
    synth = ["synth", "--rows", str(rows), "--days", "2", "--seed", str(seed), "--out", str(raw)]
    if dataset != "criteo":
        synth += ["--dataset", dataset]
    if click_rate is not None:
        synth += ["--click-rate", str(click_rate)]
    done = ctrflow_command(synth)
    if done.returncode != 0:
        return None, f"ctrflow synth: {last_line(done.stderr)}"
    days = sorted(p for p in raw.glob("day_*") if p.is_file())
    if len(days) < 2:
        return None, f"ctrflow synth wrote {len(days)} day file(s) in {raw}"
    command = ["preprocess", "--train", str(days[0]), "--valid", str(days[1]), "--out", str(processed),
               "--no-progress"]
    description = dataset_description(raw)
    if description is not None:
        command += ["--dataset", str(description)]
    done = ctrflow_command(command)
    if done.returncode != 0:
        return None, f"ctrflow preprocess: {last_line(done.stderr)}"
    return str(processed), None


def dataset_description(raw: Path) -> Path | None:
    """The dataset description synth wrote beside its days (named in synth.json, else the one YAML)."""
    meta = raw / "synth.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        for key in ("description", "dataset_description", "dataset"):
            value = info.get(key)
            if isinstance(value, str) and (raw / value).is_file():
                return raw / value
    found = sorted(raw.glob("*.yaml")) + sorted(raw.glob("*.yml"))
    return found[0] if len(found) == 1 else None


def ctrflow_command(argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m ctrflow ARGV` with tracking off."""
    return subprocess.run([sys.executable, "-m", "ctrflow", *argv, "--tracking-uri", "none"],
                          capture_output=True, text=True, env=child_env())


def child_env() -> dict[str, str]:
    """This environment, with the repository's `src` importable (the peer worker scores with it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def last_line(text: str) -> str:
    """The last non-empty line of a command's output (its one-line error)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def peer_unavailable(library: str, python: str) -> str | None:
    """Why `library` cannot run here (None: it can)."""
    if library == "ctrflow":
        return None
    if library == "deepctr-torch":
        probe = "import deepctr_torch"
    elif library == "fuxictr":
        probe = ("import fuxictr.pytorch.models as m, sys\n"
                 "sys.exit(0 if all(hasattr(m, n) for n in ('DeepFM', 'DCNv2', 'WideDeep')) else 3)")
    else:
        return f"unknown library {library!r}"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=child_env())
    if done.returncode == 3:
        return ("installed, but its package holds no DeepFM/DCNv2/WideDeep classes (its model zoo lives in "
                "its source repository); not vendored")
    if done.returncode != 0:
        return f"not importable by {python} ({last_line(done.stderr)})"
    return None


def run_one(library: str, model: str, dataset: str, data: str, work: Path, args) -> dict:
    """One training run: {library, model, dataset, auc [per epoch], best_epoch, seconds} or an error."""
    row = {"library": library, "model": model, "dataset": dataset}
    start = time.perf_counter()
    if library == "ctrflow":
        out = work / dataset / "runs" / model
        command = [sys.executable, "-m", "ctrflow", "train", "--data", data, "--model", model, "--out", str(out),
                   "--epochs", str(args.epochs), "--seed", str(args.seed), "--threads", str(args.threads),
                   "--no-progress", "--tracking-uri", "none", *shlex.split(args.ctrflow_args)]
        shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resumed or refused one
        done = subprocess.run(command, capture_output=True, text=True, env=child_env())
        if done.returncode == 0:
            row["auc"] = epoch_aucs(out / "metrics.jsonl")
            done = ctrflow_command(["evaluate", "--data", data, "--checkpoint", str(out), "--out", str(out / "eval"),
                                    "--device", "cpu"])
        if done.returncode == 0:
            row.update(kept_calibration(out / "eval" / "metrics.json"))
    else:
        command = [args.peer_python, __file__, "--worker", library, "--model", model, "--data-dir", data,
                   "--epochs", str(args.epochs), "--threads", str(args.threads), "--seed", str(args.seed)]
        done = subprocess.run(command, capture_output=True, text=True, env=child_env())
        if done.returncode == 0:
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    row["seconds"] = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        row["error"] = last_line(done.stderr)
    elif row["auc"]:
        best = int(np.argmax(row["auc"]))
        row["best_epoch"], row["best_auc"] = best + 1, row["auc"][best]
    return row


def kept_calibration(metrics: Path) -> dict:
    """From `ctrflow evaluate`'s metrics.json: the kept checkpoint's calibration ratio on the valid split,
    and the ratio of the bias training left (what the checkpoint's fitted bias replaced)."""
    found = json.loads(metrics.read_text())
    trained = (found.get("checkpoint_calibration") or {}).get("calibration_ratio_before", found["calibration_ratio"])
    return {"calibration_ratio": round(found["calibration_ratio"], 4), "trained_calibration_ratio": round(trained, 4)}


def epoch_aucs(metrics: Path) -> list[float]:
    """The validation AUCs a ctrflow run logged (one per epoch with the default `--eval-every 0`)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [round(r["auc"], 4) for r in records if "auc" in r]


def read_split(data: str, split: str) -> tuple[dict[str, np.ndarray], np.ndarray, object]:
    """({column: values}, labels, features) of a processed split: dense float32, categorical ids [N],
    multi-hot ids [N, max_length] (0-padded), in file order."""
    import pyarrow.parquet as pq

    from ctrflow.contract.schema import Schema

    features = Schema.load(data).features
    parts = sorted((Path(data) / split).glob("part-*.parquet"))
    tables = [pq.read_table(p) for p in parts]
    columns: dict[str, np.ndarray] = {}
    for f in (*features.dense, *features.sparse):
        chunks = [t.column(f.name).combine_chunks() for t in tables]
        if f.kind == "multi_hot":
            columns[f.name] = np.concatenate([c.flatten().to_numpy().reshape(-1, f.max_length) for c in chunks])
        else:
            columns[f.name] = np.concatenate([c.to_numpy(zero_copy_only=False) for c in chunks])
    labels = np.concatenate([t.column(features.label).to_numpy().astype(np.float32) for t in tables])
    return columns, labels, features


def train_peer(library: str, model: str, data: str, epochs: int, threads: int, seed: int) -> dict:
    """DeepCTR-Torch's `model` trained `epochs` epochs on the processed train split, the valid split
    scored after each: {"auc": [...], "calibration_ratio": the last epoch's mean prediction / click rate}."""
    import torch
    from deepctr_torch import models as zoo
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat

    from ctrflow.metrics import auc

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    train_x, train_y, features = read_split(data, "train")
    valid_x, valid_y, _ = read_split(data, "valid")
    columns = [DenseFeat(f.name, 1) for f in features.dense]
    for f in features.sparse:
        sparse = SparseFeat(f.name, vocabulary_size=f.cardinality, embedding_dim=DIM)
        columns.append(VarLenSparseFeat(sparse, maxlen=f.max_length, combiner=f.pooling)
                       if f.kind == "multi_hot" else sparse)
    name, extra = DEEPCTR[model]
    net = getattr(zoo, name)(columns, columns, dnn_hidden_units=MLP, task="binary", device="cpu", seed=seed, **extra)
    net.compile("adam", "binary_crossentropy")  # torch.optim.Adam, lr 1e-3
    aucs = []
    for _ in range(epochs):
        net.fit(train_x, train_y, batch_size=BATCH, epochs=1, verbose=0, shuffle=True)
        scores = net.predict(valid_x, batch_size=16384).reshape(-1)
        aucs.append(round(auc(valid_y, scores), 4))
    return {"auc": aucs, "calibration_ratio": round(float(scores.mean() / valid_y.mean()), 4)}


def machine() -> str:
    """A short description of where this ran."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


def table(results: list[dict], epochs: int) -> str:
    """Markdown: one row per (dataset, model), per library the AUC of each epoch and the calibration ratio
    (ctrflow: the kept checkpoint's, with the trained bias's in parentheses; peers: the last epoch's)."""
    libraries = list(dict.fromkeys(r["library"] for r in results))
    keys = list(dict.fromkeys((r["dataset"], r["model"]) for r in results))
    found = {(r["dataset"], r["model"], r["library"]): r for r in results}
    lines = ["| dataset | model | " + " | ".join(f"{lib}, epoch 1..{epochs} | ratio" for lib in libraries) + " |",
             "|---|---|" + "---|---|" * len(libraries)]
    for dataset, model in keys:
        cells = []
        for lib in libraries:
            r = found.get((dataset, model, lib))
            aucs = "" if r is None else r.get("error") or " / ".join(f"{a:.4f}" for a in r.get("auc", []))
            cells += [aucs, "" if r is None else ratio_cell(r)]
        lines.append(f"| {dataset} | {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_cell(row: dict) -> str:
    """`1.000 (1.372)`: the kept model's calibration ratio and, where it differs, the trained bias's."""
    ratio, trained = row.get("calibration_ratio"), row.get("trained_calibration_ratio")
    if ratio is None:
        return ""
    return f"{ratio:.3f}" + (f" ({trained:.3f})" if trained is not None and trained != ratio else "")


if __name__ == "__main__":
    sys.exit(main())
