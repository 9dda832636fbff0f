"""What the default local MLflow tracking adds to a step command; prints one JSON line.

    python benchmarks/tracking_overhead.py [--rows 1000000] [--repeats 3] [--workdir DIR]

Writes `--rows` synthetic Criteo rows once (`ctrflow synth --days 1`), then runs the whole
`ctrflow preprocess --train day_0.tsv --out OUT` process, alternating `--tracking-uri none` and the
default local store (`sqlite:///mlflow.db` in the working directory), `--repeats` times each, and
a process that only imports mlflow and opens that store (`floor`: what any tracked command pays in
CPU, however early it starts), and one that only imports mlflow (`import`). It reports the median wall time of each, the difference and ratio
against `none`, and the CPU seconds (user + system of the command and its children, the tracking
child included). The store is created by one untimed tracked run first: its schema is made once per
store, not per command, and `store_seconds` reports that first run separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of one command."""
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


FLOOR = """
import gc
gc.disable()  # as the tracking child does
from ctrflow.tracking.mlflow_tracker import open_store
open_store("sqlite:///mlflow.db", "ctrflow")
"""


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="keep the rows and the store here (default: a temp dir)")
    args = parser.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctrflow-tracking-"))
    work.mkdir(parents=True, exist_ok=True)
    ctrflow = [sys.executable, "-m", "ctrflow"]
    raw = work / "raw" / "day_0.tsv"
    if not raw.exists():
        subprocess.run([*ctrflow, "synth", "--rows", str(args.rows), "--days", "1", "--out", str(raw.parent),
                        "--tracking-uri", "none"], check=True, stdout=subprocess.DEVNULL)
    step = ["preprocess", "--train", str(raw), "--out", str(work / "out")]
    (work / "mlflow.db").unlink(missing_ok=True)
    shutil.rmtree(work / "mlruns", ignore_errors=True)
    store_seconds, _ = timed([*ctrflow, *step], work)  # creates the store's schema

    runs: dict[str, list[tuple[float, float]]] = {"none": [], "tracked": [], "floor": [], "import": []}
    for _ in range(args.repeats):  # alternated, so that a change in the machine's load hits them all
        runs["none"].append(timed([*ctrflow, *step, "--tracking-uri", "none"], work))
        runs["tracked"].append(timed([*ctrflow, *step], work))
        runs["floor"].append(timed([sys.executable, "-c", FLOOR], work))
        runs["import"].append(timed([sys.executable, "-c", "import mlflow"], work))
    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    print(json.dumps({
        "benchmark": "tracking_overhead", "command": "ctrflow " + " ".join(step), "rows": args.rows,
        "repeats": args.repeats, "none_seconds": round(wall["none"], 2), "tracked_seconds": round(wall["tracked"], 2),
        "difference_seconds": round(wall["tracked"] - wall["none"], 2),
        "ratio": round(wall["tracked"] / wall["none"], 3), "floor_seconds": round(wall["floor"], 2),
        "import_seconds": round(wall["import"], 2),
        "none_cpu_seconds": round(cpu["none"], 2), "tracked_cpu_seconds": round(cpu["tracked"], 2),
        "floor_cpu_seconds": round(cpu["floor"], 2),
        "store_seconds": round(store_seconds, 2), "all_seconds": {k: [round(w, 2) for w, _ in v] for k, v in runs.items()},
        "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
    }))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
