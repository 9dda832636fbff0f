"""The steps only the daily cycle has (`ctrflow_pipelines.daily`): read the loop's state, preprocess
the new day against the previous vocabularies, and promote + record the day. The state is a folder
every task can reach (a shared volume, or a local path in a local run): `ctrflow.daily`."""

from typing import List, NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Model, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def day_inputs(state: str, day_files: str, days_back: int = 1) -> NamedTuple(
        "DayInputs", day_files=str, vocab_from=str, init_from=str, base=str):
    """The day's inputs from the state folder: its raw file patterns (`{date}` -> the date `days_back`
    days before the run's UTC date), the previous vocabularies, the champion's checkpoint and the served
    repository ("" for what does not exist yet: the first day)."""
    from collections import namedtuple

    from ctrflow.daily import DailyState, resolve_day_files

    inputs = DailyState.load(state).inputs()
    files = resolve_day_files(day_files, days_back=days_back)
    print(f"day files {files!r}; inputs {inputs}")
    return namedtuple("DayInputs", "day_files vocab_from init_from base")(files, **inputs)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def preprocess_day(raw: Input[Dataset], files: List[dict], data: Output[Dataset], vocab_from: str = "",
                   freq_threshold: int = 0, seed: int = 0):
    """`ctrflow preprocess` of the day's files of `raw` (`raw_data`'s list: the day's rows, a fraction
    of them held out) with `--vocab-from` the previous day's output when there is one. Metadata: rows,
    cardinalities, vocabulary hash and its parent's."""
    import json
    import os
    from pathlib import Path

    from ctrflow.cli import main

    described = str(files[0].get("dataset") or "criteo") if files else "criteo"
    dataset = str(Path(raw.path) / described) if Path(raw.path, described).is_file() else described
    argv = ["preprocess", "--dataset", dataset, "--out", data.path, "--seed", str(seed),
            "--workers", str(len(os.sched_getaffinity(0))), "--tracking-uri", "none"]
    for split in ("train", "valid"):
        names = [str(Path(raw.path) / f["name"]) for f in files if f["split"] == split]
        if names:
            argv += [f"--{split}", *names]
    fractions = {float(f["valid_fraction"]) for f in files if f["split"] == "train"}
    if max(fractions, default=0.0) > 0:
        argv += ["--valid-fraction", str(max(fractions))]
    if freq_threshold > 0:
        argv += ["--freq-threshold", str(freq_threshold)]
    if vocab_from:
        argv += ["--vocab-from", vocab_from]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    schema = json.loads((Path(data.path) / "schema.json").read_text())
    data.metadata.update(rows=schema["rows"], cardinalities=schema["cardinalities"],
                         vocab_hash=schema.get("vocab_hash"), parent=(schema.get("parent") or {}).get("vocab_hash"))


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def promote_day(data: Input[Dataset], checkpoint: Input[Model], state: str, name: str = "ctr",
                min_gain: float = 0.0, backend: str = "onnxruntime", tracking_uri: str = "",
                experiment: str = "ctrflow", parent_run_id: str = "", kfp_run_id: str = "") -> bool:
    """`ctrflow promote --data` on the day's held-out rows (candidate against champion, logged to
    MLflow), then record the day in the state: the vocabularies always; when promoted, the checkpoint
    as the champion, published as the next version of the served repository. Returns whether it was."""
    import contextlib
    import io
    import json

    from ctrflow.cli import main
    from ctrflow.daily import record_day
    from ctrflow.tracking import tracking_argv

    argv = ["promote", "--model", name, "--data", data.path, "--split", "valid", "--min-gain", str(min_gain),
            "--json", *tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the verdict, one JSON line
        code = main(argv)
    print(printed.getvalue(), end="")
    if code not in (0, 1):  # 1: refused, a normal outcome of the day
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    verdict = json.loads(printed.getvalue().strip().splitlines()[-1])
    recorded = record_day(state, data.path, checkpoint.path, verdict["promoted"], name=name, backend=backend,
                          verdict=verdict)
    print(f"day {recorded.day} recorded in {state}: promoted={verdict['promoted']} ({verdict['reason']})")
    return bool(verdict["promoted"])
