"""The ctrflow KFP pipeline: raw data -> preprocess (fanned out per file) -> train -> evaluate -> export.

One graph for every setting:
- `raw_data` synthesizes the days when no source is given, else copies the given files: one `raw`
  artifact either way, and the list of files the preprocessing fans out over. The `dataset`
  parameter says how the rows are read: the built-in raw Criteo TSV ("criteo"), a dataset
  description file inside the raw data folder, or, synthesized, "movielens-like".
- Preprocessing is `ctrflow preprocess`'s per-file fan-out: `ParallelFor` over the files for the
  count pass, one merge, `ParallelFor` for the transform, one finalize. Its output is exactly the
  single-process output, so there is no separate single-process path to maintain.
- One train task for 0..N GPUs: the accelerator limit is the `num_gpus` parameter and the type is
  decided at run time (`accelerator_type`: "" on CPU, so the pod asks for no GPU at all); more than
  one GPU runs torchrun, with a memory-backed /dev/shm for its workers.
- Optional tuning before it (`tune_trials` > 0): one `tune` task runs the whole Optuna study,
  `tune_parallel` trials at a time on the train task's resources, and hands its best.yaml to the
  train task, which trains that config. With `tune_trials` 0 the task returns at once and the train
  task uses its flags (docs/tuning.md says why one task rather than a task per trial).

MLflow: `start_run` opens one parent run, every step logs a child run under it and `finish_run` in
the exit handler closes it. The data tasks take no run-specific inputs so that KFP caching reuses
them across runs; `track_data` (never cached) logs their child runs from their outputs.
"""

from kfp import dsl, kubernetes

from ctrflow_components import (accelerator_type, count_values, evaluate, export, finalize_data, finish_run,
                                merge_counts, start_run, track_data, train, transform_file, tune)
from ctrflow_components import raw_data as fetch_raw_data  # the pipeline parameter `raw_data` shadows the name
from ctrflow_components.image import IMAGE_ENV, TRAIN_IMAGE
from ctrflow_pipelines.trainjob import SHARED

PIPELINE_NAME = "ctrflow"
SHM_SIZE = "16Gi"  # torchrun workers and DataLoader workers share tensors through /dev/shm
# the search space file's text: the ranges of Merlin-on-Vertex's DeepFM tuning job, widened, and the embedding size
TUNE_SPACE = ("{lr: {low: 0.0003, high: 0.01, log: true}, sparse_lr: {low: 0.003, high: 0.1, log: true}, "
              "embedding_dim: {choices: [8, 16, 32]}, dropout: {choices: [0.0, 0.2, 0.4]}}")


def add_preprocessing(raw, files, freq_threshold, seed):
    """Add the per-file fan-out over `files` (raw_data's list); returns the finalize task."""
    with dsl.ParallelFor(files, name="count-files") as file:
        counted = count_values(raw=raw, file=file, seed=seed).set_display_name("count")
    merged = merge_counts(counts=dsl.Collected(counted.outputs["counts"]), freq_threshold=freq_threshold)
    merged.set_display_name("merge")
    with dsl.ParallelFor(files, name="transform-files") as file:
        parts = transform_file(raw=raw, file=file, vocab=merged.outputs["vocab"], seed=seed)
        parts.set_display_name("transform")
    return finalize_data(counts=dsl.Collected(counted.outputs["counts"]), vocab=merged.outputs["vocab"],
                         parts=dsl.Collected(parts.outputs["parts"])).set_display_name("preprocess")


def request_gpus(task, kind, num_gpus):
    """Give `task` `num_gpus` GPUs of the type `kind` (an `accelerator_type` task) and a memory-backed /dev/shm."""
    # the compiler does not count an output used only in resources as a dependency
    task.set_accelerator_type(kind.output).set_accelerator_limit(num_gpus).after(kind)
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=SHM_SIZE)
    return task


def add_training(data, settings: dict, num_gpus, gpu_type, tracking: dict, tuning: dict | None = None,
                 nodes=1, volume="", name: str = "train", cache: bool = True):
    """Add the train task on `num_gpus` GPUs (0: CPU); with `tuning` (the tune task's trials, parallel
    and space), the tune task before it on the same resources, whose best config it trains (the tune
    task is a no-op at 0 trials). With `nodes` > 1 the train task, on no GPU itself, runs a TrainJob
    of `nodes` nodes of `num_gpus` GPUs each, the PVC `volume` mounted in it and in every node.
    Returns the checkpoint of whichever ran."""
    tuned = {}
    if tuning is not None:
        kind = accelerator_type(num_gpus=num_gpus, gpu_type=gpu_type).set_display_name("tune accelerator")
        task = request_gpus(tune(data=data, **tuning, **settings, **tracking).set_display_name("tune"), kind, num_gpus)
        tuned = {"config": task.outputs["Output"]}
    # the compiler passes no output used only in resources into a branch: the train task's type is decided in its own
    with dsl.If(nodes == 1, name="one-node"):
        kind = accelerator_type(num_gpus=num_gpus, gpu_type=gpu_type).set_display_name("accelerator")
        here = request_gpus(train(data=data, num_gpus=num_gpus, **tuned, **settings, **tracking), kind, num_gpus)
    with dsl.Else(name="several-nodes"):
        job = train(data=data, num_gpus=num_gpus, nodes=nodes, volume=volume, **tuned, **settings, **tracking)
        kubernetes.mount_pvc(job, pvc_name=volume, mount_path=SHARED)
        job.set_env_variable(IMAGE_ENV, TRAIN_IMAGE)  # the job's nodes run the task's image
    for task, shown in ((here, name), (job, f"{name} (TrainJob)")):
        task.set_display_name(shown).set_caching_options(cache)
    return dsl.OneOf(here.outputs["checkpoint"], job.outputs["checkpoint"])


@dsl.pipeline(name=PIPELINE_NAME, description="CTR on any described dataset: preprocess, train, evaluate, "
                                              "export to Triton; tracked in MLflow.")
def ctrflow_pipeline(
    raw_data: str = "",
    dataset: str = "criteo",
    train_files: str = "day_0.*",
    valid_files: str = "day_1.*",
    valid_fraction: float = 0.0,
    synth_rows: int = 200000,
    synth_days: int = 2,
    seed: int = 0,
    freq_threshold: int = 0,
    model: str = "dlrm",
    epochs: int = 1,
    batch_size: int = 0,
    embedding_dim: int = 0,
    learning_rate: float = 0.0,
    max_steps: int = 0,
    num_gpus: int = 0,
    train_nodes: int = 1,
    train_volume: str = "",
    tune_trials: int = 0,
    tune_parallel: int = 2,
    tune_space: str = TUNE_SPACE,
    model_name: str = "ctr",
    export_backend: str = "onnxruntime",
    gpu_type: str = "nvidia.com/gpu",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "ctrflow",
):
    """raw_data: folder of raw files, a local path or a gs://, s3:// or hdfs:// URI (empty:
    synthesize `synth_days` days of `synth_rows` rows); dataset: "criteo" (raw Criteo TSV) or the
    file name of a dataset description (YAML/JSON) inside raw_data, or with no raw_data the
    synthetic dataset ("criteo" or "movielens-like"); train_files / valid_files: comma-separated glob
    patterns inside it (no valid files: hold out `valid_fraction` of the training rows).
    freq_threshold: occurrences a value needs for its own id (0: the description's default).
    model: a registered model's name (`ctrflow train --model`'s choices: `ctrflow.models.MODELS`).
    batch_size, embedding_dim, learning_rate, max_steps: 0 keeps the train step's default. num_gpus: GPUs of the train task (0: CPU; more than 1: torchrun); gpu_type: their
    resource name (`nvidia.com/gpu` on Kubernetes, e.g. `NVIDIA_H100_80GB` on Vertex AI).
    train_nodes: more than 1 trains as a Kubeflow Trainer TrainJob of that many nodes of `num_gpus`
    GPUs each, in the task's image; on a cluster `train_volume` names the PVC (ReadWriteMany) that
    carries the data and checkpoint between the task and the nodes (outside Kubernetes, the nodes
    are containers of this machine's Docker or podman).
    tune_trials: trials of the tuning stage before training (0: no tuning), `tune_parallel` at a
    time, over `tune_space` (a search space file's YAML text, freq_threshold excepted); the other
    train settings are every trial's base.
    mlflow_tracking_uri: "" means the image's $MLFLOW_TRACKING_URI, else a SQLite file in the
    task's working directory; "none": no tracking."""
    kfp_run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    closing = finish_run(tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, kfp_run_id=kfp_run_id)
    closing.set_display_name("close MLflow run").set_caching_options(False)
    with dsl.ExitHandler(closing, name="tracked"):
        opening = start_run(
            tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            kfp_run_id=kfp_run_id,
            params={"raw_data": raw_data, "dataset": dataset, "train_files": train_files, "valid_files": valid_files,
                    "valid_fraction": valid_fraction, "synth_rows": synth_rows, "synth_days": synth_days,
                    "seed": seed, "freq_threshold": freq_threshold, "model": model, "epochs": epochs,
                    "batch_size": batch_size, "embedding_dim": embedding_dim,
                    "learning_rate": learning_rate, "max_steps": max_steps, "num_gpus": num_gpus,
                    "train_nodes": train_nodes, "tune_trials": tune_trials, "tune_parallel": tune_parallel,
                    "model_name": model_name, "export_backend": export_backend, "gpu_type": gpu_type},
        ).set_display_name("open MLflow run").set_caching_options(False)
        tracking = {"tracking_uri": mlflow_tracking_uri, "experiment": mlflow_experiment,
                    "parent_run_id": opening.output, "kfp_run_id": kfp_run_id}
        raw = fetch_raw_data(source=raw_data, train_files=train_files, valid_files=valid_files,
                             valid_fraction=valid_fraction, synth_rows=synth_rows, synth_days=synth_days,
                             seed=seed, dataset=dataset).set_display_name("raw data")
        data = add_preprocessing(raw.outputs["raw"], raw.outputs["Output"], freq_threshold, seed).outputs["data"]
        track_data(raw=raw.outputs["raw"], data=data, **tracking).set_display_name("track data").set_caching_options(False)
        settings = {"model": model, "epochs": epochs, "batch_size": batch_size, "embedding_dim": embedding_dim,
                    "learning_rate": learning_rate, "max_steps": max_steps, "seed": seed}
        tuning = {"trials": tune_trials, "parallel": tune_parallel, "space": tune_space}
        checkpoint = add_training(data, settings, num_gpus, gpu_type, tracking, tuning, train_nodes, train_volume)
        scored = evaluate(data=data, checkpoint=checkpoint, **tracking).set_display_name("evaluate")
        export(data=data, checkpoint=checkpoint, report=scored.outputs["report"], name=model_name,
               backend=export_backend, **tracking).set_display_name("export")
