"""The ctrflow KFP pipeline: (synth or import) -> preprocess -> train -> evaluate -> export.

One MLflow parent run per pipeline run: `start_run` opens it, every step logs a child run under
it, and `finish_run` in the exit handler closes it whatever happened.

Two run-time choices are branches (`dsl.If`/`dsl.Else`), not settings: where the raw data comes
from, and whether training asks for GPUs (a CPU run carries no accelerator request at all).
KFP's local runner cannot merge artifacts from branches (`dsl.OneOf` of artifacts), so each branch
carries its own downstream tasks; `add_training` and `add_evaluation` build them once per branch.
"""

from kfp import dsl

from components import evaluate, export, finish_run, preprocess, start_run, synth, train

PIPELINE_NAME = "ctrflow"


def add_evaluation(data, checkpoint, model_name: str, export_backend: str, tracking: dict) -> None:
    """Add the evaluate and export tasks of a checkpoint trained on `data`."""
    evaluate(data=data, checkpoint=checkpoint, **tracking).set_display_name("evaluate")
    export(data=data, checkpoint=checkpoint, name=model_name, backend=export_backend,
           **tracking).set_display_name("export")


def add_training(data, settings: dict, gpus: dict, model_name: str, export_backend: str, tracking: dict) -> None:
    """Add the train task (on `gpus["num_gpus"]` GPUs of type `gpus["gpu_type"]`, or on CPU when
    there are none) and its evaluate and export tasks."""
    num_gpus = gpus["num_gpus"]
    with dsl.If(num_gpus > 0, name="on-gpus"):
        on_gpus = train(data=data, num_gpus=num_gpus, **settings, **tracking).set_display_name("train")
        on_gpus.set_accelerator_type(gpus["gpu_type"]).set_accelerator_limit(num_gpus)
        add_evaluation(data, on_gpus.outputs["checkpoint"], model_name, export_backend, tracking)
    with dsl.Else(name="on-cpu"):
        on_cpu = train(data=data, num_gpus=0, **settings, **tracking).set_display_name("train")
        add_evaluation(data, on_cpu.outputs["checkpoint"], model_name, export_backend, tracking)


@dsl.pipeline(name=PIPELINE_NAME, description="Criteo CTR: preprocess, train, evaluate, export to Triton; "
                                              "tracked in MLflow.")
def ctrflow_pipeline(
    raw_data: str = "",
    train_files: str = "day_0.tsv*",
    valid_files: str = "day_1.tsv*",
    valid_fraction: float = 0.0,
    synth_rows: int = 200000,
    synth_days: int = 2,
    seed: int = 0,
    freq_threshold: int = 6,
    model: str = "dlrm",
    epochs: int = 1,
    batch_size: int = 0,
    embedding_dim: int = 0,
    learning_rate: float = 0.0,
    max_steps: int = 0,
    num_gpus: int = 0,
    model_name: str = "ctr",
    export_backend: str = "onnxruntime",
    gpu_type: str = "nvidia.com/gpu",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "ctrflow",
):
    """raw_data: URI of a folder of raw Criteo files (empty: synthesize `synth_days` days of
    `synth_rows` rows); train_files / valid_files: comma-separated glob patterns inside it (no
    valid files: hold out `valid_fraction` of the training rows). batch_size, embedding_dim,
    learning_rate, max_steps: 0 keeps the train step's default. num_gpus: GPUs of the train task
    (0: CPU; more than 1: torchrun); gpu_type: their resource name (`nvidia.com/gpu` on Kubernetes,
    e.g. `NVIDIA_H100_80GB` on Vertex AI). mlflow_tracking_uri: "" means the image's
    $MLFLOW_TRACKING_URI, else a SQLite file in the task's working directory; "none": no tracking."""
    kfp_run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    closing = finish_run(tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, kfp_run_id=kfp_run_id)
    closing.set_display_name("close MLflow run").set_caching_options(False)
    with dsl.ExitHandler(closing, name="tracked"):
        opening = start_run(
            tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            kfp_run_id=kfp_run_id,
            params={"raw_data": raw_data, "train_files": train_files, "valid_files": valid_files,
                    "valid_fraction": valid_fraction, "synth_rows": synth_rows, "synth_days": synth_days,
                    "seed": seed, "freq_threshold": freq_threshold, "model": model, "epochs": epochs,
                    "batch_size": batch_size, "embedding_dim": embedding_dim,
                    "learning_rate": learning_rate, "max_steps": max_steps, "num_gpus": num_gpus,
                    "model_name": model_name, "export_backend": export_backend, "gpu_type": gpu_type},
        ).set_display_name("open MLflow run").set_caching_options(False)
        tracking = {"tracking_uri": mlflow_tracking_uri, "experiment": mlflow_experiment,
                    "parent_run_id": opening.output, "kfp_run_id": kfp_run_id}
        settings = {"model": model, "epochs": epochs, "batch_size": batch_size, "embedding_dim": embedding_dim,
                    "learning_rate": learning_rate, "max_steps": max_steps, "seed": seed}
        gpus = {"num_gpus": num_gpus, "gpu_type": gpu_type}
        split = {"train_files": train_files, "valid_files": valid_files, "valid_fraction": valid_fraction,
                 "freq_threshold": freq_threshold}
        with dsl.If(raw_data == "", name="synthetic-data"):
            generated = synth(rows=synth_rows, days=synth_days, seed=seed, **tracking).set_display_name("synth")
            data = preprocess(raw=generated.outputs["raw"], **split, **tracking).set_display_name("preprocess")
            add_training(data.outputs["data"], settings, gpus, model_name, export_backend, tracking)
        with dsl.Else(name="given-data"):
            imported = dsl.importer(artifact_uri=raw_data, artifact_class=dsl.Dataset).set_display_name("raw data")
            data = preprocess(raw=imported.output, **split, **tracking).set_display_name("preprocess")
            add_training(data.outputs["data"], settings, gpus, model_name, export_backend, tracking)
