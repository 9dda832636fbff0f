"""The container image every component runs in (docker/Dockerfile.train builds it).

A setting, not a published tag: `$CTRFLOW_IMAGE` when set, else the name `make images` gives a
local build. `ctrflow pipeline compile|run|submit|schedule --image` set it for one command."""

import os

IMAGE_ENV = "CTRFLOW_IMAGE"
LOCAL_IMAGE = "localhost/ctrflow/ctrflow-train:0.1.0"
TRAIN_IMAGE = os.environ.get(IMAGE_ENV) or LOCAL_IMAGE


def use_image(pipeline, image: str):
    """`pipeline` (a @dsl.pipeline) with every container task's image set to `image`; returns it."""
    executors = pipeline.pipeline_spec.deployment_spec["executors"]
    for name in executors:
        if "container" in executors[name]:  # importers have none
            container = executors[name]["container"]
            container["image"] = image
            for variable in container["env"] if "env" in container else []:  # a task that names its own image
                if variable["name"] == IMAGE_ENV:
                    variable["value"] = image
    return pipeline
