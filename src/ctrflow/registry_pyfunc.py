"""The registry's pyfunc model as code (MLflow's models-from-code): MLflow copies this file into each
registered model and runs it when the model loads, so loading unpickles no Python object."""

import mlflow.models

from ctrflow.registry import RawRowsModel

mlflow.models.set_model(RawRowsModel())
