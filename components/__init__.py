"""One thin KFP component per ctrflow step: a typed signature that maps artifacts to the step's
CLI flags, then describes the outputs in artifact metadata. No logic lives here.

Each body imports ctrflow itself (only the body is shipped to the container), so the image named
by `TRAIN_IMAGE` must have ctrflow installed (docker/Dockerfile.train).
"""

from components.image import TRAIN_IMAGE
from components.evaluate import evaluate
from components.export import export
from components.preprocess import preprocess
from components.synth import synth
from components.tracking import finish_run, start_run
from components.train import train

__all__ = ["TRAIN_IMAGE", "evaluate", "export", "finish_run", "preprocess", "start_run", "synth", "train"]
