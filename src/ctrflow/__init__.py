"""ctrflow: an end-to-end click-through-rate recommender pipeline."""

import os as _os

__version__ = "0.1.0"

# MLflow reads these when first imported (always after this package) or as it runs: its usage telemetry
# stays off, and its INFO lines and "View run at" links (to the GenAI view, on a fresh browser) stay out
# of the steps' output, unless the user sets them otherwise.
_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
_os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
_os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
