"""ctrflow: an end-to-end click-through-rate recommender pipeline."""

import os as _os

__version__ = "0.1.0"

# MLflow reads these once, when it is first imported (always after this package): its usage telemetry
# stays off and its INFO lines stay out of the steps' output unless the user sets them otherwise.
_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
_os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
