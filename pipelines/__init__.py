"""The KFP pipeline of ctrflow and the ways to run it: compile, local run, submit (KFP or Vertex AI)."""

from pipelines.pipeline import PIPELINE_NAME, ctrflow_pipeline

__all__ = ["PIPELINE_NAME", "ctrflow_pipeline"]
