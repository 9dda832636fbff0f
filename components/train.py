"""`ctrflow train` as a component; with more than one GPU it runs under torchrun."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Model, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def train(data: Input[Dataset], checkpoint: Output[Model], model: str = "dlrm", epochs: int = 1,
          batch_size: int = 0, embedding_dim: int = 0, learning_rate: float = 0.0, max_steps: int = 0,
          num_gpus: int = 0, seed: int = 0, tracking_uri: str = "", experiment: str = "ctrflow",
          parent_run_id: str = "", kfp_run_id: str = "", init_from: str = "", config: str = ""):
    """Train `model` (a registered model's name: `ctrflow train --model`'s choices) on `data` into
    `checkpoint`. Zero for batch_size, embedding_dim, learning_rate
    or max_steps means the step's own default (no limit for max_steps). `init_from`: a checkpoint
    to warm-start from (`--init-from`; "" trains from scratch). `config`: a config file's text (the
    tune task's best.yaml) that sets every field instead of the flags above; "" for none. Metadata:
    model, steps, final loss and validation AUC, the checkpoint it started from, and the best
    validation's AUC and step (the checkpoint that the evaluate and export components read)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    argv = ["train", "--data", data.path, "--out", checkpoint.path, "--no-progress"]
    if config:  # the tuned run: its file holds the model, epochs and seed the flags would give
        path = Path(tempfile.mkdtemp()) / "config.yaml"
        path.write_text(config)
        argv += ["--config", str(path)]
    else:
        argv += ["--model", model, "--epochs", str(epochs), "--seed", str(seed)]
        optional = {"--batch-size": batch_size, "--embedding-dim": embedding_dim, "--lr": learning_rate,
                    "--max-steps": max_steps}
        argv += [part for flag, value in optional.items() if value for part in (flag, str(value))]
    if init_from:
        argv += ["--init-from", init_from]
    argv += tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})
    if num_gpus > 1:  # one process per GPU; only rank 0 opens the MLflow run
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={num_gpus}", "-m", "ctrflow", *argv], check=True)
    elif main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    records = [json.loads(line) for line in (Path(checkpoint.path) / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evaluated = [r for r in records if r.get("auc") is not None]
    summary = json.loads((Path(checkpoint.path) / "train_summary.json").read_text())
    # the checkpoint directory's best step is what the evaluate and export components read
    checkpoint.metadata.update(model=model, tuned=bool(config), num_gpus=num_gpus,
                               steps=records[-1]["step"] if records else 0,
                               loss=records[-1].get("loss") if records else None,
                               valid_auc=evaluated[-1]["auc"] if evaluated else None, init_from=init_from,
                               best_valid_auc=summary.get("best_valid_auc"), best_step=summary.get("best_step"))
