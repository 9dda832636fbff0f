"""`ctrflow export` as a component: a validated Triton model repository, registered in MLflow."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def export(data: Input[Dataset], checkpoint: Input[Model], report: Input[Artifact], repository: Output[Model],
           name: str = "ctr",
           backend: str = "onnxruntime", tracking_uri: str = "", experiment: str = "ctrflow",
           parent_run_id: str = "", kfp_run_id: str = "", base: str = ""):
    """Write the Triton ensemble `name` into `repository` (the export step also registers it in
    MLflow with alias `candidate`, tagged with the AUC of evaluate's `report`, so that `ctrflow
    promote` can compare versions). `base`: a served repository; `repository` then holds its ensemble
    with the next version beside it and the delta (`--base`; the base itself is left alone).
    Metadata: name, backend, validation result, registered version, version and delta sizes."""
    import contextlib
    import io
    import json

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    argv = ["export", "--checkpoint", checkpoint.path, "--data", data.path, "--out", repository.path,
            "--name", name, "--backend", backend, "--metrics", report.path,
            *tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})]
    if base:
        argv += ["--base", base]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the step prints its summary as one JSON line
        code = main(argv)
    print(printed.getvalue(), end="")
    if code != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    summary = json.loads(printed.getvalue().strip().splitlines()[-1])
    repository.metadata.update({k: summary[k] for k in ("name", "backend", "max_abs_diff", "rows",
                                                        "registered_version", "version") if k in summary})
    if "delta" in summary:
        repository.metadata["delta"] = summary["delta"]
