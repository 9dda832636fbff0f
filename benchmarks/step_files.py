"""Which ctrflow source files one training step runs: the files a batch crosses from the loop to the
optimizer update.

    PYTHONPATH=src python3 benchmarks/step_files.py [--skip 1] TRAIN FLAGS...
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/step_files.py --device cpu TRAIN FLAGS...

Runs `ctrflow train` with the given flags (add `--max-steps 4 --tracking-uri none --no-progress`) and,
after its first `--skip` steps, records with `sys.setprofile` every Python function called while the loop's
step function (`ctrflow.train.loop.train_step`, also inside a CUDA graph's warm-up and capture) runs: the
batch's copy to the device, forward, loss, backward, the optimizer update. Prints one JSON line (rank 0):
the files under `ctrflow/` that ran, their count and their packages. A CUDA graph's replays run no
Python: trace GPU runs with `--cuda-graphs off` to see the captured step's code. Backward functions that
autograd runs on its own device threads (CUDA) are seen where Python can profile every thread (3.12+).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import ctrflow
from ctrflow.cli import main as ctrflow_main
from ctrflow.train import loop

ROOT = Path(ctrflow.__file__).parent


def traced(step, seen: set[str], skip: int):
    """`step` recording the ctrflow files of every Python call it makes, after its first `skip` calls."""
    calls = {"n": 0}

    main_thread = threading.main_thread()

    def profile(frame, event, _arg):
        # the step's thread, or one Python did not start (autograd's); never the loader's prefetch thread
        if event == "call" and (threading.current_thread() is main_thread or
                                isinstance(threading.current_thread(), threading._DummyThread)):
            seen.add(frame.f_code.co_filename)

    def run(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= skip:
            return step(*args, **kwargs)
        every = getattr(threading, "setprofile_all_threads", None)
        (every or sys.setprofile)(profile)
        try:
            return step(*args, **kwargs)
        finally:
            (getattr(threading, "setprofile_all_threads", None) or sys.setprofile)(None)

    return run


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", type=int, default=1, help="steps run before the trace starts")
    args, train_flags = p.parse_known_args()  # the rest: `ctrflow train` flags
    seen: set[str] = set()
    loop.train_step = traced(loop.train_step, seen, args.skip)  # the loop reads it when the run starts
    code = ctrflow_main(["train", *[a for a in train_flags if a != "--"]])
    files = sorted(str(Path(f).resolve().relative_to(ROOT)) for f in seen
                   if Path(f).resolve().is_relative_to(ROOT))
    packages = sorted({str(Path(f).parent) if "/" in f else "." for f in files})
    record = {"exit": code, "world_size": int(os.environ.get("WORLD_SIZE", 1)), "files": len(files),
              "packages": len({p.split("/")[0] for p in packages}), "subpackages": packages, "paths": files}
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
