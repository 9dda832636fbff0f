"""Submit the pipeline to a Kubeflow Pipelines endpoint, or to Vertex AI Pipelines."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from ctrflow.errors import UserError
from ctrflow_pipelines.compile import compile_pipeline

HEALTHZ = "/apis/v2beta1/healthz"  # what kfp.Client asks first
PROBE_SECONDS = 10


def submit_kfp(host: str, arguments: dict[str, Any], experiment: str = "ctrflow",
               run_name: str | None = None, namespace: str | None = None, pipeline: str = "ctrflow") -> str:
    """Create a run of `pipeline` on the KFP API server at `host`; returns the KFP run id.
    A host that cannot be reached, or that answers with an error, is a one-line `UserError`."""
    import kfp

    host = api_host(host)
    with tempfile.TemporaryDirectory() as tmp, kfp_api(host):
        package = compile_pipeline(Path(tmp) / "pipeline.yaml", pipeline)
        client = kfp.Client(host=host, namespace=namespace)
        run = client.create_run_from_pipeline_package(str(package), arguments=arguments, run_name=run_name,
                                                      experiment_name=experiment, namespace=namespace)
    return run.run_id


def api_host(host: str) -> str:
    """`host` as kfp.Client reads it (https:// unless a scheme is given), checked to answer HTTP."""
    host = host if host.startswith(("http://", "https://")) else "https://" + host
    check_reachable(host)
    return host


@contextlib.contextmanager
def kfp_api(host: str):
    """Calls to the KFP API at `host` inside: its error answers, and a health check that kept failing,
    become one-line `UserError`s; the client's warnings and retry tracebacks are not shown."""
    from kfp_server_api.exceptions import ApiException

    with quiet_client():
        try:
            yield
        except ApiException as err:
            raise UserError(f"--host {host}: the KFP API answered HTTP {err.status} {err.reason}: "
                            f"{one_line(err.body)}") from None
        except TimeoutError:  # kfp.Client's health check retried and gave up
            raise UserError(f"--host {host}: GET {HEALTHZ} kept failing: is it a Kubeflow Pipelines API?") from None


def check_reachable(host: str) -> None:
    """Refuse a host that does not answer HTTP (refused, unknown name, timeout, TLS failure):
    kfp.Client would retry for seconds and end in a long traceback. Any HTTP answer passes
    (the KFP client's own authentication may be needed for a 200)."""
    try:
        with urllib.request.urlopen(host.rstrip("/") + HEALTHZ, timeout=PROBE_SECONDS):
            return
    except urllib.error.HTTPError as err:
        if err.code == 404:  # a server, but no KFP API at this URL (kfp.Client would retry for 25 s)
            raise UserError(f"--host {host}: GET {HEALTHZ} answered HTTP 404: no Kubeflow Pipelines API at "
                            f"this URL") from None
        return
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        text = getattr(reason, "strerror", None) or str(reason)
        raise UserError(f"--host {host}: cannot reach a Kubeflow Pipelines API (GET {HEALTHZ}: {text})") from None


@contextlib.contextmanager
def quiet_client():
    """kfp.Client warns that it needs KFP >= 2.0.0-beta.2 on every call and logs each failed
    health check with a traceback: our own one-line errors replace both."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"kfp\.")
        previous = logging.root.manager.disable
        logging.disable(logging.ERROR)
        try:
            yield
        finally:
            logging.disable(previous)


def one_line(text: Any, limit: int = 300) -> str:
    """A server's error body on one line, cut to `limit` characters."""
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def submit_vertex(project: str, region: str, pipeline_root: str, arguments: dict[str, Any],
                  display_name: str = "ctrflow", service_account: str | None = None, pipeline: str = "ctrflow") -> str:
    """Submit a Vertex AI PipelineJob of `pipeline` (needs the `vertex` extra); returns its resource name."""
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
        package = compile_pipeline(Path(tmp) / "pipeline.yaml", pipeline)
        # Vertex AI reads one document: the pipeline spec (the Kubernetes platform spec is KFP's)
        spec = next(yaml.safe_load_all(package.read_text()))
        package.write_text(yaml.safe_dump(spec, sort_keys=False))
        job = aiplatform.PipelineJob(display_name=display_name, template_path=str(package),
                                     pipeline_root=pipeline_root, parameter_values=arguments)
        job.submit(service_account=service_account)
    return job.resource_name
