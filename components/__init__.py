"""One thin KFP component per ctrflow step: a typed signature that maps artifacts to the step's
CLI flags, then describes the outputs in artifact metadata. No logic lives here.

Each body imports ctrflow itself (only the body is shipped to the container), so the image named
by `TRAIN_IMAGE` must have ctrflow installed (docker/Dockerfile.train).
"""

from ctrflow_components.image import TRAIN_IMAGE
from ctrflow_components.daily import day_inputs, preprocess_day, promote_day
from ctrflow_components.evaluate import evaluate
from ctrflow_components.export import export
from ctrflow_components.preprocess import count_values, finalize_data, merge_counts, transform_file
from ctrflow_components.raw_data import raw_data
from ctrflow_components.resources import accelerator_type
from ctrflow_components.tracking import finish_run, start_run, track_data
from ctrflow_components.train import train
from ctrflow_components.tune import tune

__all__ = ["TRAIN_IMAGE", "accelerator_type", "count_values", "day_inputs", "evaluate", "export", "finalize_data",
           "finish_run", "merge_counts", "preprocess_day", "promote_day", "raw_data", "start_run", "track_data", "train",
           "transform_file", "tune"]
