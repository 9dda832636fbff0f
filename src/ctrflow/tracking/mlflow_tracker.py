"""`Tracker` on MLflow, through an explicit `MlflowClient` (no global mlflow state).

Several trackers may live in one process (the pipeline's parent run and a step's child run),
so every call names its run id. A child run points at its parent with the `mlflow.parentRunId`
tag, which is what the MLflow UI nests on.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from ctrflow.tracking.base import Tracker
from ctrflow.tracking.pipeline_summary import summarize_pipeline_run
from ctrflow.tracking.ui import RUNS_VIEW, SHARED_VIEW_TAG, runs_view_state

PARENT_TAG = "mlflow.parentRunId"
KFP_RUN_TAG = "kfp.run_id"
STEP_TAG = "ctrflow.step"
MODEL_VERSIONS_TAG = "mlflow.modelVersions"  # a logged model's registered versions, as JSON
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # marks an experiment as model training (not GenAI) in the UI
EXPERIMENT_KIND = "custom_model_development"
BATCH = 100  # MLflow accepts at most 100 params, 1000 metrics and 100 tags per log_batch call
PARAM_CHARS = 6000  # MLflow's limit on a param value


class MlflowTracker(Tracker):
    """One MLflow run: a new one in `experiment` (nested under `parent_run_id` when given),
    or an existing one when `run_id` is given (to log into or close it)."""

    def __init__(self, uri: str, experiment: str = "ctrflow", run_name: str | None = None,
                 parent_run_id: str | None = None, tags: Mapping[str, str] | None = None,
                 start_ms: int | None = None, run_id: str | None = None) -> None:
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self._closed = False
        if run_id:
            run = self.client.get_run(run_id)
        else:
            run = self.client.create_run(ensure_experiment(self.client, uri, experiment), start_time=start_ms,
                                         run_name=run_name, tags=describe_run(parent_run_id, tags or {}))
        self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
        self.experiment_id, self.parent_run_id = run.info.experiment_id, run.data.tags.get(PARENT_TAG)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings, cut to MLflow's limit); `None` values are skipped."""
        self.log_batch(params={k: v for k, v in params.items() if v is not None})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None,
                    timestamp_ms: int | None = None) -> None:
        """Log scalar metrics at `step` (0 when not given), stamped `timestamp_ms` (default: now);
        non-numbers are refused by float()."""
        now = timestamp_ms or int(time.time() * 1000)
        self.log_batch(metrics=[(k, v, now, step or 0) for k, v in metrics.items()])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (values as strings)."""
        self.log_batch(tags=tags)

    def log_batch(self, params: Mapping[str, Any] | None = None, metrics: list[tuple] = (),
                  tags: Mapping[str, str] | None = None) -> None:
        """Log params, metrics (`(key, value, timestamp_ms, step)`) and tags in as few calls as
        MLflow's limits per call allow."""
        items = ([Param(str(k), str(v)[:PARAM_CHARS]) for k, v in (params or {}).items()],
                 [Metric(str(k), float(v), int(t), int(s)) for k, v, t, s in metrics],
                 [RunTag(str(k), str(v)) for k, v in (tags or {}).items()])
        for i in range(0, max(map(len, items)), BATCH):
            self.client.log_batch(self.run_id, params=items[0][i:i + BATCH], metrics=items[1][i:i + BATCH],
                                  tags=items[2][i:i + BATCH], synchronous=True)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Attach a file, or a directory's contents under `artifact_path` (default: its name)."""
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def register_model(self, name: str, path: str | os.PathLike, **kwargs: Any) -> str:
        """Register the files of the local folder `path` as a new version of model `name` and point
        the alias (`alias=`, default `candidate`) at it. `description=` describes the version; every
        other keyword (e.g. `backend=`) becomes a version tag. The version's files are a logged model
        of this run (`log_model`), which links it to this run and its pipeline run."""
        alias = kwargs.pop("alias", "candidate")
        description = kwargs.pop("description", None)
        tags = {str(k): str(v) for k, v in {**kwargs.pop("tags", {}), **kwargs}.items()}
        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        model = self.log_model(name, path)
        version = self.client.create_model_version(name, source=model.artifact_location, run_id=self.run_id,
                                                   tags=tags, description=description, model_id=model.model_id)
        # what the UI reads to show a logged model's versions (a tracking server sets it, a local store does not)
        self.client.set_logged_model_tags(
            model.model_id, {MODEL_VERSIONS_TAG: json.dumps([{"name": name, "version": str(version.version)}])})
        if alias:
            self.client.set_registered_model_alias(name, alias, version.version)
        self.set_tags({"ctrflow.registered_model": f"{name}/{version.version}"})
        return str(version.version)

    def log_model(self, name: str, path: str | os.PathLike):
        """A logged model named `name` holding the files of the local folder `path`, an output of this
        run and of its pipeline run. MLflow 3 registers versions from logged models, lists them in the
        experiment's Models tab and shows a run the versions of its output models. The files cross
        to the store once, straight into the logged model (a model holds its checkpoint)."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        from ctrflow.registry import quiet_artifact_transfers

        model = self.client.create_logged_model(self.experiment_id, name=name, source_run_id=self.run_id,
                                                model_type="ctrflow")
        with quiet_artifact_transfers():
            self.client.log_model_artifacts(model.model_id, str(path))
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        for run_id in filter(None, (self.run_id, self.parent_run_id)):
            self.client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
        return model

    def close(self, status: str = "FINISHED", end_ms: int | None = None) -> None:
        """End the run with `status` (FINISHED, FAILED or KILLED) at `end_ms` (default: now); later
        calls do nothing."""
        if not self._closed:
            self.client.set_terminated(self.run_id, status, end_time=end_ms)
            self._closed = True


def open_store(uri: str, experiment: str) -> None:
    """Open the store at `uri` and make sure `experiment` exists: the slow part of a first run."""
    ensure_experiment(MlflowClient(tracking_uri=uri), uri, experiment)


def ensure_experiment(client: MlflowClient, uri: str, name: str) -> str:
    """The id of experiment `name`, created if missing (safe when several steps race to it).

    With a local SQLite store, artifacts go beside the database file (`<dir>/mlruns`) rather than
    into whatever directory the step happens to run in. Tags: `experiment_tags`.
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        for key, value in experiment_tags().items():  # made elsewhere: add what is missing, change nothing set
            if key not in found.tags:
                client.set_experiment_tag(found.experiment_id, key, value)
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=local_artifact_root(uri), tags=experiment_tags())
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def experiment_tags() -> dict[str, str]:
    """Every ctrflow experiment's tags: model training (not GenAI), and the runs view with their AUC."""
    return {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, SHARED_VIEW_TAG + RUNS_VIEW: runs_view_state()}


def local_artifact_root(uri: str) -> str | None:
    """`<db dir>/mlruns` for a `sqlite:///FILE` store; None (the server's choice) otherwise."""
    prefix = "sqlite:///"  # sqlite:///rel.db is relative to the working directory, sqlite:////abs.db absolute
    if not uri.startswith(prefix) or uri[len(prefix):] in ("", ":memory:"):
        return None
    return (Path(uri[len(prefix):]).resolve().parent / "mlruns").as_uri()


def describe_run(parent_run_id: str | None, tags: Mapping[str, str]) -> dict[str, str]:
    """The tags a new run starts with: the caller's, the parent link, user and git commit."""
    described = {"mlflow.user": current_user(), **{str(k): str(v) for k, v in tags.items()}}
    if parent_run_id:
        described[PARENT_TAG] = parent_run_id
    commit = git_commit()
    if commit:
        described.setdefault("mlflow.source.git.commit", commit)
    return described


def current_user() -> str:
    """The login name, or 'unknown' in containers without one."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def git_commit() -> str | None:
    """The commit of the checkout ctrflow runs from; None outside git (e.g. in the image)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def finish_pipeline_run(uri: str, experiment: str, kfp_run_id: str, status: str) -> str | None:
    """Close the parent run of pipeline run `kfp_run_id` with `status`, after summarizing its steps on
    it (`summarize_pipeline_run`: headline and `<step>.<metric>` metrics, plots, links to each step's
    run and to the registered model); returns its id (None when not found)."""
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], f"tags.`{KFP_RUN_TAG}` = '{kfp_run_id}'")
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    if not parents:
        return None
    parent = MlflowTracker(uri, run_id=parents[0].info.run_id)
    children = client.search_runs([found.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.run_id}'")
    summarize_pipeline_run(client, parent.run_id, children)
    parent.close(status)
    return parent.run_id
