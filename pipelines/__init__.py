"""The KFP pipeline of ctrflow and the ways to run it: compile, local run, submit (KFP or Vertex AI).

Installed as `ctrflow_pipelines`; it registers the `ctrflow pipeline` and `ctrflow demo` commands
through the `ctrflow.commands` entry point group (the library never imports this package).
"""

__all__ = ["PIPELINE_NAME", "ctrflow_pipeline"]


def __getattr__(name: str):
    # kfp loads when the pipeline is used, not when `ctrflow --help` lists the commands
    if name in __all__:
        from ctrflow_pipelines import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
