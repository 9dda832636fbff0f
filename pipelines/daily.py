"""The daily cycle as a KFP pipeline, `ctrflow-daily`: one new day of data per run.

    state ──▶ raw data (the day's files) ──▶ preprocess --vocab-from (yesterday's vocabularies)
          ──▶ train --init-from (the champion) ──▶ evaluate ──▶ export --base (the served repository)
          ──▶ promote (candidate against champion on the day's held-out rows) + record the day

The loop's state (`ctrflow.daily`: vocabularies, champion checkpoint, served repository) is a folder
every task reaches (`state`: a shared volume on a cluster, a local path in a local run); the first
run on an empty state trains from scratch and publishes version 1. Run it every day with
`ctrflow pipeline schedule --cron ...`: `day_files` may hold `{date}`, the day before the run's (YYYY-MM-DD;
`days_back` days before).
Every task runs each time (no caching): they all depend on the state, which changes from day to day.
Promotion needs the MLflow registry (`mlflow_tracking_uri` other than "none").
"""

from kfp import dsl

from ctrflow_components import (day_inputs, evaluate, export, finish_run, preprocess_day, promote_day, raw_data,
                                start_run)
from ctrflow_pipelines.pipeline import add_training

DAILY_PIPELINE_NAME = "ctrflow-daily"


@dsl.pipeline(name=DAILY_PIPELINE_NAME,
              description="One day of continuous training: grow the vocabularies, warm-start the champion, "
                          "export the next version, promote it when it scores better on the day's held-out rows.")
def daily_pipeline(
    state: str,
    raw_dir: str,
    day_files: str = "{date}*",
    days_back: int = 1,
    dataset: str = "criteo",
    holdout_fraction: float = 0.1,
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
    gpu_type: str = "nvidia.com/gpu",
    model_name: str = "ctr",
    export_backend: str = "onnxruntime",
    min_gain: float = 0.0,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "ctrflow-daily",
):
    """state: the loop's folder (`ctrflow.daily`); raw_dir: where the days' raw files land (a local path
    or a gs://, s3://, hdfs:// URI) and `day_files` the day's comma-separated glob patterns in it
    (`{date}`: the date `days_back` days before the run's, in UTC); dataset: "criteo" (raw Criteo TSV) or the file name of a dataset
    description in raw_dir; holdout_fraction: the share of the day's rows held out to score
    candidate and champion on. The other parameters are the main pipeline's (model and training
    settings; a warm start keeps the champion's architecture) and `ctrflow promote --min-gain`."""
    kfp_run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    closing = finish_run(tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, kfp_run_id=kfp_run_id)
    closing.set_display_name("close MLflow run").set_caching_options(False)
    with dsl.ExitHandler(closing, name="tracked"):
        opening = start_run(
            tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            kfp_run_id=kfp_run_id,
            params={"state": state, "raw_dir": raw_dir, "day_files": day_files, "dataset": dataset, "holdout_fraction": holdout_fraction,
                    "model": model, "epochs": epochs, "min_gain": min_gain, "model_name": model_name},
        ).set_display_name("open MLflow run").set_caching_options(False)
        tracking = {"tracking_uri": mlflow_tracking_uri, "experiment": mlflow_experiment,
                    "parent_run_id": opening.output, "kfp_run_id": kfp_run_id}
        inputs = day_inputs(state=state, day_files=day_files, days_back=days_back)
        inputs.set_display_name("day inputs").set_caching_options(False)
        raw = raw_data(source=raw_dir, train_files=inputs.outputs["day_files"], valid_files="",
                       valid_fraction=holdout_fraction, seed=seed, dataset=dataset).set_display_name("raw data")
        raw.set_caching_options(False)
        data = preprocess_day(raw=raw.outputs["raw"], files=raw.outputs["Output"],
                              vocab_from=inputs.outputs["vocab_from"], freq_threshold=freq_threshold, seed=seed)
        data.set_display_name("preprocess").set_caching_options(False)
        settings = {"model": model, "epochs": epochs, "batch_size": batch_size, "embedding_dim": embedding_dim,
                    "learning_rate": learning_rate, "max_steps": max_steps, "seed": seed,
                    "init_from": inputs.outputs["init_from"]}
        checkpoint = add_training(data.outputs["data"], settings, num_gpus, gpu_type, tracking, nodes=train_nodes,
                                  volume=train_volume, name="warm-start train", cache=False)
        scored = evaluate(data=data.outputs["data"], checkpoint=checkpoint, **tracking)
        scored.set_display_name("evaluate").set_caching_options(False)
        exported = export(data=data.outputs["data"], checkpoint=checkpoint,
                          report=scored.outputs["report"], name=model_name, backend=export_backend,
                          base=inputs.outputs["base"], **tracking)
        exported.set_display_name("export next version").set_caching_options(False)
        promoted = promote_day(data=data.outputs["data"], checkpoint=checkpoint, state=state,
                               name=model_name, min_gain=min_gain, backend=export_backend, **tracking)
        # promote reads the candidate the export registered
        promoted.set_display_name("promote and record the day").set_caching_options(False).after(exported)
