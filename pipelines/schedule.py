"""A recurring run of a pipeline on a Kubeflow Pipelines API server (`ctrflow pipeline schedule`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ctrflow.errors import UserError
from ctrflow_pipelines.compile import compile_pipeline
from ctrflow_pipelines.submit import api_host, kfp_api


def kfp_cron(expression: str) -> str:
    """A cron expression as KFP's scheduler reads it: six fields, seconds first. The usual five
    fields ("0 3 * * *": minute, hour, day of month, month, day of week) get "0" seconds."""
    fields = expression.split()
    if len(fields) == 5:
        return " ".join(["0", *fields])
    if len(fields) == 6:
        return " ".join(fields)
    raise UserError(f"--cron {expression!r}: a cron expression has 5 fields (minute hour day month weekday, "
                    f"e.g. \"0 3 * * *\") or 6 (seconds first), not {len(fields)}")


def schedule_kfp(host: str, cron: str, arguments: dict[str, Any], pipeline: str = "daily",
                 experiment: str = "ctrflow", job_name: str | None = None, namespace: str | None = None,
                 max_concurrency: int = 1, catchup: bool = False) -> str:
    """Create a recurring run of `pipeline` (compiled now, with `arguments` as its parameters) on the
    KFP API server at `host`, started by `cron`; returns the recurring run's id."""
    import kfp

    if max_concurrency < 1:
        raise UserError(f"--max-concurrency {max_concurrency}: must be at least 1")
    expression = kfp_cron(cron)
    host = api_host(host)  # one line for a host without a KFP API, as `submit`
    with tempfile.TemporaryDirectory() as tmp, kfp_api(host):
        package = compile_pipeline(Path(tmp) / "pipeline.yaml", pipeline)
        client = kfp.Client(host=host, namespace=namespace)
        experiment_id = client.create_experiment(experiment, namespace=namespace).experiment_id
        recurring = client.create_recurring_run(
            experiment_id, job_name or f"ctrflow-{pipeline}", cron_expression=expression,
            pipeline_package_path=str(package), params=arguments, max_concurrency=max_concurrency,
            no_catchup=not catchup)
    return recurring.recurring_run_id
