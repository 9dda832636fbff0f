"""`ctrflow preprocess` fanned out per input file: count (each file) -> merge -> transform (each
file) -> finalize, giving exactly the single-process output (`ctrflow.ingest.fanout`). No tracking
inputs, so KFP can cache every task; `track_data` logs the result to MLflow."""

from typing import List

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def count_values(raw: Input[Dataset], file: dict, counts: Output[Artifact], seed: int = 0,
                 on_bad_rows: str = "error"):
    """The fit pass over one file of `raw` (`file` is an item of `raw_data`'s list) into `counts`; the
    file's `dataset` (the built-in "criteo", or a description file in `raw`) says how to read it."""
    import os
    from pathlib import Path

    from ctrflow.cli import main

    described = str(file.get("dataset") or "criteo")
    dataset = str(Path(raw.path) / described) if Path(raw.path, described).is_file() else described
    argv = ["preprocess", "count", "--dataset", dataset, "--input", str(Path(raw.path) / file["name"]),
            "--file-index", str(int(float(file["index"]))), "--split", file["split"], "--seed", str(seed),
            "--on-bad-rows", on_bad_rows, "--workers", str(len(os.sched_getaffinity(0))), "--out", counts.path]
    if float(file["valid_fraction"]) > 0:
        argv += ["--valid-fraction", str(float(file["valid_fraction"]))]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def merge_counts(counts: Input[List[Artifact]], vocab: Output[Artifact], freq_threshold: int = 0):
    """Every file's counts -> the vocabularies and the part numbering, in `vocab`. `freq_threshold`:
    the default threshold (0: the dataset description's; per-column ones apply beside it)."""
    from ctrflow.cli import main

    argv = ["preprocess", "merge", "--counts", *[c.path for c in counts], "--out", vocab.path]
    if freq_threshold > 0:
        argv += ["--freq-threshold", str(freq_threshold)]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def transform_file(raw: Input[Dataset], file: dict, vocab: Input[Artifact], parts: Output[Artifact],
                   seed: int = 0, on_bad_rows: str = "error"):
    """One file of `raw` -> its Parquet parts in `parts`, numbered as a single run numbers them."""
    import os
    from pathlib import Path

    from ctrflow.cli import main

    argv = ["preprocess", "transform", "--input", str(Path(raw.path) / file["name"]),
            "--file-index", str(int(float(file["index"]))), "--split", file["split"], "--seed", str(seed),
            "--on-bad-rows", on_bad_rows, "--workers", str(len(os.sched_getaffinity(0))),
            "--vocab", vocab.path, "--out", parts.path]
    if float(file["valid_fraction"]) > 0:
        argv += ["--valid-fraction", str(float(file["valid_fraction"]))]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def finalize_data(counts: Input[List[Artifact]], vocab: Input[Artifact], parts: Input[List[Artifact]],
                  data: Output[Dataset]):
    """Assemble the processed dataset (Parquet, schema.json, vocab/, stats.json) in `data`.
    Metadata: rows per split, cardinalities, threshold, vocabulary hash."""
    import json
    from pathlib import Path

    from ctrflow.cli import main

    argv = ["preprocess", "finalize", "--counts", *[c.path for c in counts], "--vocab", vocab.path,
            "--parts", *[p.path for p in parts], "--out", data.path]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    schema = json.loads((Path(data.path) / "schema.json").read_text())
    data.metadata.update(rows=schema["rows"], cardinalities=schema["cardinalities"],
                         freq_threshold=schema["freq_threshold"], vocab_hash=schema.get("vocab_hash"))
