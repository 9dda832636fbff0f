"""Where the raw day files come from, as one task: synthesized when no source is given, otherwise
copied from the given folder (a local path, or a URI pyarrow opens: gs://, s3://, hdfs://).
Either way one `raw` artifact and the list of files the preprocessing fans out over."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def raw_data(source: str, train_files: str, valid_files: str, raw: Output[Dataset], valid_fraction: float = 0.0,
             synth_rows: int = 200000, synth_days: int = 2, seed: int = 0) -> list:
    """Fill `raw` with the files of `source` matching `train_files` / `valid_files` (comma-separated
    glob patterns), or with `synth_days` synthetic days of `synth_rows` rows when `source` is "".
    Returns one item per file in input order (train files first, then valid): name, index, split and
    the valid_fraction its rows are split by (0 when valid files are given). No tracking inputs, so
    KFP can cache it (the `track_data` task describes it in MLflow); its cache key is the source
    URI, not the files' content: submit with caching off when files change under the same URI."""
    import fnmatch
    import json
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.preprocess.files import expand_inputs
    from ctrflow.errors import UserError

    def patterns(names: str) -> list:
        return [p.strip() for p in names.split(",") if p.strip()]

    out = Path(raw.path)
    if not source:
        argv = ["synth", "--rows", str(synth_rows), "--days", str(synth_days), "--seed", str(seed), "--out",
                raw.path, "--tracking-uri", "none"]
        if main(argv) != 0:
            raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    else:
        import pyarrow.fs as pafs

        try:
            fs, root = pafs.FileSystem.from_uri(source if "://" in source else str(Path(source).resolve()))
            listed = fs.get_file_info(pafs.FileSelector(root))
        except (OSError, ValueError) as err:
            raise RuntimeError(f"raw data {source}: cannot list it ({err})") from None
        wanted = [info for info in listed if info.is_file and any(
            fnmatch.fnmatch(info.base_name, p) for p in patterns(train_files) + patterns(valid_files))]
        out.mkdir(parents=True, exist_ok=True)
        for info in wanted:
            pafs.copy_files(info.path, str(out / info.base_name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
    try:  # the order `ctrflow preprocess --train ... --valid ...` reads them in
        train = expand_inputs([out / p for p in patterns(train_files)])
        valid = expand_inputs([out / p for p in patterns(valid_files)])
    except UserError as err:
        raise RuntimeError(f"raw data {source or '(synthetic)'}: {err}") from None
    fraction = 0.0 if valid else valid_fraction
    files = [{"name": p.name, "index": i, "split": "train", "valid_fraction": fraction} for i, p in enumerate(train)]
    files += [{"name": p.name, "index": len(train) + i, "split": "valid", "valid_fraction": 0.0}
              for i, p in enumerate(valid)]
    raw.metadata.update(source=source or "synthetic", files=[f["name"] for f in files])
    if (out / "synth.json").exists():
        report = json.loads((out / "synth.json").read_text())
        raw.metadata.update(rows_per_day=synth_rows, days=synth_days, seed=seed, teacher_auc=report["teacher_auc"])
    return files
