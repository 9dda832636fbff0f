"""Where the raw day files come from, as one task: synthesized when no source is given, otherwise
copied from the given folder (a local path, or a URI pyarrow opens: gs://, s3://, hdfs://).
Either way one `raw` artifact and the list of files the preprocessing fans out over, each naming
the dataset description its rows are read with."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def raw_data(source: str, train_files: str, valid_files: str, raw: Output[Dataset], valid_fraction: float = 0.0,
             synth_rows: int = 200000, synth_days: int = 2, seed: int = 0, dataset: str = "criteo") -> list:
    """Fill `raw` with the files of `source` matching `train_files` / `valid_files` (comma-separated
    glob patterns), or with `synth_days` synthetic days of `synth_rows` rows when `source` is "".

    `dataset` says how the rows are read: "criteo" (the built-in raw Criteo TSV), or the file name
    of a dataset description (YAML or JSON) inside `source`, copied along; with no source, the
    synthetic dataset to write ("criteo" or "movielens-like", whose description `synth` writes
    beside the days). Returns one item per file in input order (train files first, then valid):
    name, index, split, the valid_fraction its rows are split by (0 when valid files are given) and
    the dataset ("criteo" or the description's file name in `raw`). No tracking inputs, so KFP can
    cache it (the `track_data` task describes it in MLflow); its cache key is the source URI, not the
    files' content: submit with caching off when files change under the same URI."""
    import fnmatch
    import json
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.errors import UserError
    from ctrflow.contract.formats.files import expand_inputs

    def patterns(names: str) -> list:
        return [p.strip() for p in names.split(",") if p.strip()]

    out = Path(raw.path)
    described = "criteo"  # what the preprocessing's --dataset gets, relative to `raw`
    if not source:
        argv = ["synth", "--dataset", dataset, "--rows", str(synth_rows), "--days", str(synth_days),
                "--seed", str(seed), "--out", raw.path, "--tracking-uri", "none"]
        if main(argv) != 0:
            raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
        described = json.loads((out / "synth.json").read_text()).get("description", "criteo")
    else:
        import pyarrow.fs as pafs

        try:
            fs, root = pafs.FileSystem.from_uri(source if "://" in source else str(Path(source).resolve()))
            listed = fs.get_file_info(pafs.FileSelector(root))
        except (OSError, ValueError) as err:
            raise RuntimeError(f"raw data {source}: cannot list it ({err})") from None
        if dataset != "criteo":
            if not any(info.is_file and info.base_name == dataset for info in listed):
                raise RuntimeError(f"raw data {source}: no dataset description {dataset!r} in it "
                                   f"(--dataset is criteo or a description file inside the raw data folder)")
            described = dataset
        wanted = [info for info in listed if info.is_file and (info.base_name == described or any(
            fnmatch.fnmatch(info.base_name, p) for p in patterns(train_files) + patterns(valid_files)))]
        out.mkdir(parents=True, exist_ok=True)
        for info in wanted:
            pafs.copy_files(info.path, str(out / info.base_name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
    try:  # the order `ctrflow preprocess --train ... --valid ...` reads them in
        train = [p for p in expand_inputs([out / p for p in patterns(train_files)]) if p.name != described]
        valid = [p for p in expand_inputs([out / p for p in patterns(valid_files)]) if p.name != described]
    except UserError as err:
        raise RuntimeError(f"raw data {source or '(synthetic)'}: {err}") from None
    fraction = 0.0 if valid else valid_fraction
    files = [{"name": p.name, "index": i, "split": "train", "valid_fraction": fraction, "dataset": described}
             for i, p in enumerate(train)]
    files += [{"name": p.name, "index": len(train) + i, "split": "valid", "valid_fraction": 0.0, "dataset": described}
              for i, p in enumerate(valid)]
    raw.metadata.update(source=source or "synthetic", files=[f["name"] for f in files], dataset=described)
    if (out / "synth.json").exists():
        report = json.loads((out / "synth.json").read_text())
        raw.metadata.update(rows_per_day=synth_rows, days=synth_days, seed=seed, teacher_auc=report["teacher_auc"])
    return files
