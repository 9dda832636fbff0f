"""MLflow bookkeeping of one pipeline run: open the parent run, describe the (cacheable) data
tasks under it, and close it.

`finish_run` runs in the pipeline's exit handler, so a failed step still closes the parent run
(as FAILED). An exit task may not depend on other tasks, so it finds the parent run by the KFP run
id tag instead of taking `start_run`'s output.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def start_run(tracking_uri: str, experiment: str, run_name: str, kfp_run_id: str, params: dict) -> str:
    """Create the parent MLflow run tagged with the KFP run id and log the pipeline's parameters;
    returns its run id ("" when tracking is off)."""
    import re

    from ctrflow.tracking import start_pipeline_run

    # pipeline parameters inside a dict arrive as strings, integers as "1.0"
    params = {k: re.sub(r"^(-?\d+)\.0$", r"\1", str(v)) for k, v in params.items()}
    run_id = start_pipeline_run(tracking_uri, experiment, run_name, kfp_run_id, params)
    print(f"MLflow parent run: {run_id or '(tracking off)'}")
    return run_id


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def track_data(raw: Input[Dataset], data: Input[Dataset], tracking_uri: str = "", experiment: str = "ctrflow",
               parent_run_id: str = "", kfp_run_id: str = ""):
    """Log the child runs `synth` (synthetic raw data only) and `preprocess` of this pipeline run from
    the data tasks' outputs. The data tasks take no run-specific inputs so that KFP can reuse them;
    this task always runs, so every pipeline run shows the data it trained on, cached or not."""
    from pathlib import Path

    from ctrflow.tracking import track_dataset

    for step in track_dataset(Path(raw.path), Path(data.path), tracking_uri, experiment, parent_run_id,
                              {"kfp.run_id": kfp_run_id}):
        print(f"MLflow child run {step['run_id'] or '(tracking off)'}: {step['step']}")


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def finish_run(tracking_uri: str, experiment: str, kfp_run_id: str, status: dsl.PipelineTaskFinalStatus):
    """Close the parent MLflow run: FINISHED when every step succeeded, FAILED (or KILLED) otherwise."""
    from ctrflow.tracking import finish_pipeline_run

    final = {"SUCCEEDED": "FINISHED", "CANCELLED": "KILLED"}.get(status.state, "FAILED")
    run_id = finish_pipeline_run(tracking_uri, experiment, kfp_run_id, final)
    print(f"MLflow parent run {run_id}: {final} (pipeline {status.state})")
