"""The container image every component runs in (docker/Dockerfile.train builds and tags it)."""

TRAIN_IMAGE = "ghcr.io/ctrflow/ctrflow-train:0.1.0"
