"""`ctrflow synth` as a component: synthetic raw Criteo day files."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def synth(rows: int, days: int, seed: int, raw: Output[Dataset], tracking_uri: str = "",
          experiment: str = "ctrflow", parent_run_id: str = "", kfp_run_id: str = ""):
    """Write `days` day files of `rows` rows into `raw`; metadata: rows, days, teacher AUC per day."""
    import json
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    argv = ["synth", "--rows", str(rows), "--days", str(days), "--seed", str(seed), "--out", raw.path,
            *tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    report = json.loads((Path(raw.path) / "synth.json").read_text())
    raw.metadata.update(rows_per_day=rows, days=days, seed=seed, files=[f["path"] for f in report["files"]],
                        teacher_auc=report["teacher_auc"])
