"""`ctrflow tune` as a component: one task running the whole study, `parallel` trials at a time."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def tune(data: Input[Dataset], study: Output[Artifact], trials: int, parallel: int, space: str,
         model: str = "dlrm", epochs: int = 1, batch_size: int = 0, embedding_dim: int = 0,
         learning_rate: float = 0.0, max_steps: int = 0, seed: int = 0, tracking_uri: str = "",
         experiment: str = "ctrflow", parent_run_id: str = "", kfp_run_id: str = "") -> str:
    """Search `space` (the search space file's YAML text) over `trials` trials of `ctrflow train` on
    `data`, the train step's settings (0: its default; `model` a registered model's name) as every
    trial's base. `study` holds best.yaml, trials.csv, the plots and each trial's log and metrics (no
    checkpoints: the train task trains the best config again). Returns best.yaml's text for the train task; "" when `trials` is 0
    (no tuning: the task does nothing). Metadata: the best trial, its AUC and parameters."""
    import csv
    from pathlib import Path

    import yaml

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    if trials == 0:
        return ""
    if "freq_threshold" in (yaml.safe_load(space) or {}):
        # the train, evaluate and export tasks read the preprocessed data as it is
        raise ValueError("tune_space: freq_threshold is the pipeline's own freq_threshold parameter here; "
                         "tune it with `ctrflow tune` on preprocessed data")
    folder = Path(study.path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "space.yaml").write_text(space)
    # the train step's flags as config fields: every trial starts from the run the train task would do
    base = {"model": {"name": model}, "epochs": epochs, "seed": seed}
    if embedding_dim:
        base["model"]["embedding_dim"] = embedding_dim
    if batch_size:
        base["data"] = {"batch_size": batch_size}
    if learning_rate:
        base["optim"] = {"lr": learning_rate}
    if max_steps:
        base["max_steps"] = max_steps
    (folder / "base.yaml").write_text(yaml.safe_dump(base))
    argv = ["tune", "--data", data.path, "--space", str(folder / "space.yaml"), "--config",
            str(folder / "base.yaml"), "--trials", str(trials), "--parallel", str(parallel), "--out",
            str(folder), "--keep-best", "0",
            *tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    with open(folder / "trials.csv", newline="") as f:
        complete = [row for row in csv.DictReader(f) if row["state"] == "COMPLETE"]
    best = max(complete, key=lambda row: float(row["auc"]))
    study.metadata.update(best_trial=int(best["number"]), best_auc=float(best["auc"]), trials=trials,
                          parallel=parallel, **{k: v for k, v in best.items() if k.startswith("param.")})
    return (folder / "best.yaml").read_text()
