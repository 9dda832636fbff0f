"""The MLflow model registry: a pyfunc that scores raw rows (the AUC gate is `ctrflow.promotion`).

Each export registers a model version whose files are an MLflow pyfunc model (`register_pyfunc`): it
scores a DataFrame of raw rows (one string column per raw column the dataset description names as
a feature) with the same code the Triton python models run, and carries the Triton repository
under `artifacts/triton/`. The export points the `candidate` alias at it; `ctrflow promote`
(`ctrflow.promotion`) moves `champion` to it when it passes the AUC gate.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd

from ctrflow.errors import UserError
from ctrflow.serve import raw_inputs

CANDIDATE = "candidate"
CHAMPION = "champion"
CHECKPOINT = "checkpoint"  # names of the pyfunc's artifacts
VOCABULARY = "vocabulary"
TRITON = "triton"
PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
PYFUNC_CODE = Path(__file__).with_name("registry_pyfunc.py")  # the model's code, copied into each model
CHANCE = 0.5  # the AUC of random scores: a candidate must beat it


class RawRowsModel(mlflow.pyfunc.PythonModel):
    """Scores raw rows: a DataFrame with one string column per raw column of the schema (empty or
    missing value = missing; a multi-hot value is its list as the files hold it, separated) -> a
    DataFrame with `probability` (float32), in row order.

    Runs what the Triton repository runs: ctrflow's `transform_raw` with the saved vocabularies,
    then the ranking model, so the registry's pyfunc and the server agree.
    """

    def load_context(self, context) -> None:
        """Load the weights-only checkpoint, the schema and the vocabularies from the artifacts."""
        from ctrflow.serve.preprocess import load_preprocessing
        from ctrflow.serve.ranking import load_ranking_model

        self.model = load_ranking_model(context.artifacts[CHECKPOINT])
        self.schema, self.vocab = load_preprocessing(context.artifacts[VOCABULARY])

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        """probability [N] of the N rows of `model_input`; a missing column raises naming it."""
        from ctrflow.contract.transform import description_of
        from ctrflow.serve.preprocess import transform_columns
        from ctrflow.serve.ranking import probabilities

        fields, multi_hot = raw_inputs(self.schema), description_of(self.schema).multi_hot
        missing = [name for name in fields if name not in model_input.columns]
        if missing:
            raise UserError(f"field {missing[0]}: missing from the input ({len(missing)} field(s) missing)")
        columns = {name: raw_strings(model_input[name], multi_hot[name].separator if name in multi_hot else "|")
                   for name in fields}
        dense, sparse = transform_columns(columns, self.schema, self.vocab)
        return pd.DataFrame({"probability": probabilities(self.model, dense, sparse)[:, 0]})


def raw_strings(column: pd.Series, separator: str = "|") -> list[str]:
    """A column as the raw text a file would hold: None/NaN -> "", numbers without a trailing .0,
    a list of values joined by `separator` (a multi-hot column)."""
    def text(value: Any) -> str:
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return ""
        if isinstance(value, (list, tuple, np.ndarray)):
            return separator.join(text(v) for v in value)
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return [text(v) for v in column.tolist()]


def raw_example(schema) -> pd.DataFrame:
    """The pyfunc's input example: one row with every raw column of `schema` missing (a valid request)."""
    return pd.DataFrame({name: [""] for name in raw_inputs(schema)})


def raw_signature(schema):
    """The pyfunc's signature: one string column per raw column of `schema` in, `probability` out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema as ColumnSchema

    inputs = ColumnSchema([ColSpec("string", name) for name in raw_inputs(schema)])
    return ModelSignature(inputs=inputs, outputs=ColumnSchema([ColSpec("float", "probability")]))


def save_pyfunc(checkpoint: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike,
                repository: str | os.PathLike | None = None) -> Path:
    """Write the raw-rows pyfunc model directory `out` (MLmodel + artifacts) and return it.

    Artifacts: the checkpoint's weights (no optimizer state), `data`'s schema and vocabularies,
    and the Triton repository when given. Refuses a checkpoint trained on other vocabularies.
    """
    from ctrflow.predict import load_for_data
    from ctrflow.serve.preprocess import copy_vocabularies
    from ctrflow.serve.ranking import save_ranking_model

    out = Path(out)
    model, schema, meta = load_for_data(checkpoint, data)
    with tempfile.TemporaryDirectory(prefix="ctrflow-pyfunc-") as tmp, quiet_artifact_transfers():
        artifacts = {CHECKPOINT: save_ranking_model(model, schema, meta, Path(tmp) / CHECKPOINT)}
        artifacts[VOCABULARY] = copy_vocabularies(data, Path(tmp) / VOCABULARY)
        if repository is not None:  # MLflow names an artifact's folder after its path: stage it as triton/
            artifacts[TRITON] = shutil.copytree(repository, Path(tmp) / TRITON)
        mlflow.pyfunc.save_model(
            # models-from-code: the class is imported on load, never unpickled
            path=str(out), python_model=str(PYFUNC_CODE), signature=raw_signature(schema),
            input_example=raw_example(schema),
            artifacts={k: str(v) for k, v in artifacts.items()},
            # explicit: inferring them would load the model in a subprocess; ctrflow itself comes
            # from the serving or training image (it is not on PyPI)
            pip_requirements=[f"torch=={_version('torch')}", f"numpy=={np.__version__}",
                              f"pandas=={pd.__version__}", f"pyarrow=={_version('pyarrow')}"],
            metadata={"ctrflow.model": meta.get("model", {}).get("name"), "ctrflow.step": meta.get("step")})
    return out


@contextlib.contextmanager
def quiet_artifact_transfers():
    """No "Downloading artifacts" progress bars (MLflow draws one per artifact it copies, on
    stderr) inside the block; the caller's setting is restored after it."""
    before = os.environ.get(PROGRESS_BAR)
    os.environ[PROGRESS_BAR] = "false"  # MLflow reads it at each transfer
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_BAR, None)
        else:
            os.environ[PROGRESS_BAR] = before


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def register_pyfunc(tracker, name: str, checkpoint: str | os.PathLike, data: str | os.PathLike,
                    repository: str | os.PathLike | None = None, **kwargs: Any) -> str | None:
    """Register the raw-rows pyfunc (with the Triton repository inside) as a new version of model
    `name`, a logged model of `tracker`'s run, and point the `candidate` alias at it; `kwargs` go to
    `tracker.register_model` (tags, description). Returns the version, or None when the tracker
    tracks nothing."""
    if tracker.run_id is None:
        return None  # NullTracker: tracking is off
    with tempfile.TemporaryDirectory(prefix="ctrflow-pyfunc-") as tmp:
        return tracker.register_model(name, save_pyfunc(checkpoint, data, Path(tmp) / "model", repository), **kwargs)
