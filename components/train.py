"""`ctrflow train` as a component; with more than one GPU it runs under torchrun, with more than one
node as a Kubeflow Trainer TrainJob (`ctrflow pipeline train-job`)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Model, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def train(data: Input[Dataset], checkpoint: Output[Model], model: str = "dlrm", epochs: int = 1,
          batch_size: int = 0, embedding_dim: int = 0, learning_rate: float = 0.0, max_steps: int = 0,
          num_gpus: int = 0, seed: int = 0, tracking_uri: str = "", experiment: str = "ctrflow",
          parent_run_id: str = "", kfp_run_id: str = "", init_from: str = "", config: str = "",
          nodes: int = 1, volume: str = ""):
    """Train `model` (a registered model's name: `ctrflow train --model`'s choices) on `data` into
    `checkpoint`. Zero for batch_size, embedding_dim, learning_rate
    or max_steps means the step's own default (no limit for max_steps). `init_from`: a checkpoint
    to warm-start from (`--init-from`; "" trains from scratch). `config`: a config file's text (the
    tune task's best.yaml) that sets every field instead of the flags above; "" for none.
    `nodes` > 1: `ctrflow pipeline train-job`, a TrainJob of that many nodes of `num_gpus` GPUs
    each in this task's image ($CTRFLOW_IMAGE), on the cluster the task runs in (the PVC `volume`,
    mounted at /mnt/ctrflow in this task, carries the data and the checkpoint) or, outside
    Kubernetes, on this machine's Docker or podman. Metadata:
    model, steps, final loss and validation AUC, the checkpoint it started from, and the best
    validation's AUC and step (the checkpoint that the evaluate and export components read)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import uuid
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    flags, inputs = ["--no-progress"], {"data": data.path}
    if config:  # the tuned run: its file holds the model, epochs and seed the flags would give
        inputs["config"] = str(Path(tempfile.mkdtemp()) / "config.yaml")
        Path(inputs["config"]).write_text(config)
    else:
        flags += ["--model", model, "--epochs", str(epochs), "--seed", str(seed)]
        optional = {"--batch-size": batch_size, "--embedding-dim": embedding_dim, "--lr": learning_rate,
                    "--max-steps": max_steps}
        flags += [part for flag, value in optional.items() if value for part in (flag, str(value))]
    if init_from and os.path.exists(init_from):  # staged for a TrainJob's nodes
        inputs["init-from"] = init_from
    elif init_from:  # a URI: every node reads it itself
        flags += ["--init-from", init_from]
    flags += tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})
    argv = ["train", "--out", checkpoint.path, *flags, *[part for k, v in inputs.items() for part in (f"--{k}", v)]]
    if nodes > 1:  # the job's nodes read the inputs from its shared folder; the checkpoint comes back here
        from urllib.parse import urlparse

        from ctrflow.tracking import resolve_tracking_uri

        backend = "kubernetes" if os.environ.get("KUBERNETES_SERVICE_HOST") else "container"
        name = f"ctrflow-train-{uuid.uuid4().hex[:8]}"
        store = resolve_tracking_uri(tracking_uri)
        # the container backend's nodes are on a network of their own, with none of this machine's files
        if backend == "container" and store != "none" and urlparse(store).hostname in (None, "127.0.0.1", "localhost"):
            print(f"the TrainJob's containers cannot reach MLflow at {store}: its training is not tracked")
            flags += ["--tracking-uri", "none"]
        job = [sys.executable, "-m", "ctrflow", "pipeline", "train-job", "--name", name, "--num-nodes", str(nodes),
               "--gpus-per-node", str(num_gpus), "--backend", backend, "--volume", volume,
               "--checkpoint-to", checkpoint.path, *[f"--stage={k}={v}" for k, v in inputs.items()], "--", *flags]
        # a fresh interpreter: this one's kfp is the executor's runtime-only build; the job's image,
        # $CTRFLOW_IMAGE, is the task's own
        env = {key: value for key, value in os.environ.items() if key != "_KFP_RUNTIME"}
        if subprocess.run(job, env=env).returncode != 0:
            raise RuntimeError(f"TrainJob {name} failed: its last log lines are above")
    elif num_gpus > 1:  # one process per GPU; only rank 0 opens the MLflow run
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={num_gpus}", "-m", "ctrflow", *argv], check=True)
    elif main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    records = [json.loads(line) for line in (Path(checkpoint.path) / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evaluated = [r for r in records if r.get("auc") is not None]
    summary = json.loads((Path(checkpoint.path) / "train_summary.json").read_text())
    # the checkpoint directory's best step is what the evaluate and export components read
    checkpoint.metadata.update(model=model, tuned=bool(config), num_gpus=num_gpus, nodes=nodes,
                               steps=records[-1]["step"] if records else 0,
                               loss=records[-1].get("loss") if records else None,
                               valid_auc=evaluated[-1]["auc"] if evaluated else None, init_from=init_from,
                               best_valid_auc=summary.get("best_valid_auc"), best_step=summary.get("best_step"))
