"""Which dataset a `--dataset` value opens for preprocessing: the built-in Criteo TSV, or a described table.

A dataset, as the preprocessing pipeline (`ctrflow.ingest.run`) uses it, has a `description`
(`ctrflow.contract.description.Description`), the `engines` it runs on, `max_lengths` of its multi-hot
features, and makes the passes' worker stages: `fit_stage(...)`, `tasks(files, chunk_rows, workers)`,
`merge_stage(runs, thresholds, range_entries, previous)` (`previous`: a
`--vocab-from` directory whose vocabularies grow, or ""), `transform_stage(data_dir, compression, vocab_dir,
tables)`; `check_inputs(paths)` checks the files' columns (and that each holds a row) before any row is
read; `settle(records, warnings)` decides after the fit pass what it leaves open (a multi-hot column's
unset max_length) and sets `truncated` (rows cut per multi-hot feature); `follow(features)` takes that
from the processed data a `--vocab-from` run grows.
"""

from __future__ import annotations

from dataclasses import replace

from ctrflow.contract.catalog import describe
from ctrflow.contract.description import Description
from ctrflow.errors import UserError


def open_dataset(spec="criteo", freq_threshold: int | None = None):
    """The dataset a `--dataset` value names, ready for `preprocess`; `freq_threshold` (if given) replaces
    the description's default threshold. An opened dataset is returned as it is."""
    if freq_threshold is not None and freq_threshold < 1:
        raise UserError(f"--freq-threshold must be at least 1, got {freq_threshold}")
    if hasattr(spec, "fit_stage"):
        return spec
    if spec is None or str(spec) == "criteo":
        from ctrflow.ingest.criteo.dataset import CriteoDataset

        return CriteoDataset(freq_threshold)
    description = describe(spec)
    if freq_threshold is not None:
        description = replace(description, default_threshold=freq_threshold)
    from ctrflow.ingest.table.dataset import TableDataset

    return TableDataset(description)


def dataset_from_dict(raw: dict, kind: str = "table", freq_threshold: int | None = None):
    """The dataset a saved description names (`Description.to_dict`; `kind` "criteo" is the built-in
    Criteo TSV), with `freq_threshold` (if given) as its default threshold."""
    if kind == "criteo":
        threshold = raw.get("freq_threshold", {}).get("default") if isinstance(raw.get("freq_threshold"), dict) \
            else None
        return open_dataset("criteo", freq_threshold if freq_threshold is not None else threshold)
    return open_dataset(Description.from_dict(raw, raw.get("name", "dataset")), freq_threshold)
