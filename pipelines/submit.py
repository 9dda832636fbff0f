"""Submit the pipeline to a Kubeflow Pipelines endpoint, or to Vertex AI Pipelines."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ctrflow_pipelines.compile import compile_pipeline


def submit_kfp(host: str, arguments: dict[str, Any], experiment: str = "ctrflow",
               run_name: str | None = None, namespace: str | None = None) -> str:
    """Create a run of the pipeline on the KFP API server at `host`; returns the KFP run id."""
    import kfp

    client = kfp.Client(host=host, namespace=namespace)
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(Path(tmp) / "pipeline.yaml")
        run = client.create_run_from_pipeline_package(str(package), arguments=arguments, run_name=run_name,
                                                      experiment_name=experiment, namespace=namespace)
    return run.run_id


def submit_vertex(project: str, region: str, pipeline_root: str, arguments: dict[str, Any],
                  display_name: str = "ctrflow", service_account: str | None = None) -> str:
    """Submit a Vertex AI PipelineJob (needs the `vertex` extra); returns its resource name."""
    from ctrflow.errors import UserError

    if not pipeline_root.startswith("gs://"):
        raise UserError(f"--pipeline-root {pipeline_root!r}: Vertex AI needs a gs:// folder")
    try:
        from google.cloud import aiplatform
    except ImportError:
        raise UserError("--vertex-project: google-cloud-aiplatform is not installed; "
                        "pip install 'ctrflow[vertex]'") from None
    aiplatform.init(project=project, location=region)
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(Path(tmp) / "pipeline.yaml")
        # Vertex AI reads one document: the pipeline spec (the Kubernetes platform spec is KFP's)
        spec = next(yaml.safe_load_all(package.read_text()))
        package.write_text(yaml.safe_dump(spec, sort_keys=False))
        job = aiplatform.PipelineJob(display_name=display_name, template_path=str(package),
                                     pipeline_root=pipeline_root, parameter_values=arguments)
        job.submit(service_account=service_account)
    return job.resource_name
