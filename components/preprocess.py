"""`ctrflow preprocess` as a component: raw day files -> Parquet, schema, vocabularies."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Output

from components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def preprocess(raw: Input[Dataset], train_files: str, valid_files: str, data: Output[Dataset],
               freq_threshold: int = 6, valid_fraction: float = 0.0, on_bad_rows: str = "error",
               tracking_uri: str = "", experiment: str = "ctrflow", parent_run_id: str = "",
               kfp_run_id: str = ""):
    """Preprocess the files of the `raw` folder matching `train_files` / `valid_files` (comma-separated
    glob patterns); with no valid files, `valid_fraction` of the training rows are held out.
    Metadata: rows per split, cardinalities, threshold, vocabulary hash."""
    import json
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    def patterns(names: str) -> list:
        return [str(Path(raw.path) / p.strip()) for p in names.split(",") if p.strip()]

    argv = ["preprocess", "--train", *patterns(train_files), "--out", data.path,
            "--freq-threshold", str(freq_threshold), "--on-bad-rows", on_bad_rows, "--no-progress"]
    if patterns(valid_files):
        argv += ["--valid", *patterns(valid_files)]
    elif valid_fraction > 0:
        argv += ["--valid-fraction", str(valid_fraction)]
    argv += tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    schema = json.loads((Path(data.path) / "schema.json").read_text())
    data.metadata.update(rows=schema["rows"], cardinalities=schema["cardinalities"],
                         freq_threshold=schema["freq_threshold"], vocab_hash=schema.get("vocab_hash"))
