"""Batch scoring: a checkpoint and the saved vocabularies turn raw rows into probabilities.

Raw files are read in the format of the dataset's description (csv, tsv or parquet, as
`schema.json` records it) into the text columns a client of the served ensemble sends. The same
two pieces then serve online: `transform_raw` is what the Triton preprocessing model runs, and
`ctrflow.serve.ranking.ProbabilityModel` is what the exported ranking model computes, so offline
and online scores agree (no training/serving skew).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import nn

from ctrflow.contract.schema import Schema
from ctrflow.errors import UserError
from ctrflow.metrics import auc
from ctrflow.serve.ranking import ProbabilityModel

SCORE_BATCH = 16384


def load_for_data(checkpoint: str | os.PathLike, data: str | os.PathLike) -> tuple[nn.Module, Schema, dict]:
    """The checkpoint's model (eval, CPU), schema and meta, after checking it matches `data`.

    A checkpoint trained on other vocabularies would silently score garbage; refuse it and
    name what differs.
    """
    from ctrflow.checkpoint import check_schema, load_model

    model, schema, meta = load_model(checkpoint)
    check_schema(schema, Schema.load(data), f"{data}/schema.json")
    return model, schema, meta


def _batches(model: nn.Module, dense: np.ndarray, sparse: np.ndarray, batch_size: int):
    """(start, stop, (dense, sparse) tensors on the model's device) per batch of rows."""
    device = next(model.parameters()).device
    for start in range(0, len(dense), batch_size):
        stop = start + batch_size
        d = torch.from_numpy(np.ascontiguousarray(dense[start:stop], dtype=np.float32))
        s = torch.from_numpy(np.ascontiguousarray(sparse[start:stop], dtype=np.int64))
        yield start, stop, (d.to(device, non_blocking=True), s.to(device, non_blocking=True))


def score_logits(model: nn.Module, dense: np.ndarray, sparse: np.ndarray, batch_size: int = SCORE_BATCH) -> np.ndarray:
    """Logits [N] float32 of `model` (on any device) on dense [N, num_dense] and sparse [N, slots] ids (the
    feature contract's batch layout, `ctrflow.contract.features`), in row order."""
    out = np.empty(len(dense), dtype=np.float32)
    with torch.inference_mode():
        for start, stop, inputs in _batches(model, dense, sparse, batch_size):
            out[start:stop] = model(*inputs).float().cpu().numpy()  # device-to-host sync per batch
    return out


def score(model: nn.Module, dense: np.ndarray, sparse: np.ndarray, batch_size: int = SCORE_BATCH) -> np.ndarray:
    """Probabilities [N] float32 of dense [N, num_dense] and sparse [N, slots] ids (as `score_logits`),
    computed exactly as the exported model computes them."""
    wrapped = ProbabilityModel(model).eval()
    out = np.empty(len(dense), dtype=np.float32)
    with torch.inference_mode():
        for start, stop, inputs in _batches(model, dense, sparse, batch_size):
            out[start:stop] = wrapped(*inputs)[:, 0].cpu().numpy()
    return out


def transform_file(path: Path, schema, vocab, keep: Sequence[str] = ()
                   ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]]:
    """(dense, sparse, labels or None, the `keep` columns' text) per block of a raw file, through the
    serving transform.

    The file is read by the description's own reader (`ctrflow.contract.formats.raw`), which checks
    every value as preprocessing does and names the file, line and column of a bad one.
    """
    from ctrflow.contract.formats.raw import read_raw_rows
    from ctrflow.contract.transform import description_of
    from ctrflow.serve.preprocess import transform_columns

    for block in read_raw_rows(path, description_of(schema), keep=keep):
        try:
            dense, sparse = transform_columns(block.columns, schema, vocab)
        except UserError as err:
            raise UserError(f"{path}: {err}") from None
        yield dense, sparse, block.labels, block.kept


def write_table(table: pa.Table, out: Path) -> None:
    """Write `.csv` or `.parquet` atomically (a partial file never looks finished). CSV: one quoting style
    for the header and the values, the csv module's minimal quoting; a null is an empty field."""
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".csv":
        with open(tmp, "w", newline="", encoding="utf-8") as sink:
            writer = csv.writer(sink, lineterminator="\n")
            writer.writerow(table.column_names)
            for batch in table.to_batches(SCORE_BATCH):
                texts = [pc.fill_null(column.cast(pa.string()), "").to_pylist() for column in batch.columns]
                writer.writerows(zip(*texts))
    else:
        pq.write_table(table, tmp)
    os.replace(tmp, out)


def _check_kept(keep: Sequence[str], label: str) -> None:
    for name in keep:
        if name == label or name in ("probability", "label"):
            raise UserError(f"--keep-columns: {name!r} would repeat the output's "
                            f"{'label' if name == label else name} column")
    if len(set(keep)) != len(keep):
        raise UserError(f"--keep-columns: a column is named twice ({', '.join(keep)})")


def predict(checkpoint: str | os.PathLike, data: str | os.PathLike, inputs: Sequence[str | os.PathLike],
            out: str | os.PathLike, batch_size: int = SCORE_BATCH, keep: Sequence[str] = ()) -> dict:
    """Score raw files of the dataset `data` was preprocessed from (its description's format;
    plain or gzip text, with or without the label column, in the order given) into `out`.

    `out` (.csv or .parquet) has, in input row order, the `keep` columns of the inputs as text (ids to
    join the scores back on), a `probability` column, and `label` when the inputs carry labels (null
    for rows of a file without one, or with an empty label).
    """
    from ctrflow.contract.formats.files import expand_inputs
    from ctrflow.serve.preprocess import load_preprocessing

    out = Path(out)
    if out.suffix not in (".csv", ".parquet"):
        raise UserError(f"--out {out}: must end in .csv or .parquet")
    model, _, _ = load_for_data(checkpoint, data)
    schema, vocab = load_preprocessing(data)  # checked against schema.json's hash, as the server does
    _check_kept(keep, (schema.dataset or {}).get("label", "label"))
    scores, labels, kept = [], [], {name: [] for name in keep}
    for path in expand_inputs(inputs):
        for dense, sparse, label, texts in transform_file(path, schema, vocab, keep):
            scores.append(score(model, dense, sparse, batch_size))
            labels.append(label if label is not None else np.full(len(dense), np.nan, np.float32))
            for name in keep:
                kept[name].append(texts[name])
    probability = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    label = np.concatenate(labels) if labels else np.zeros(0, np.float32)
    columns = {name: pa.chunked_array(parts, pa.string()) for name, parts in kept.items()}
    columns["probability"] = pa.array(probability, pa.float32())
    summary = {"rows": int(len(probability)), "out": str(out)}
    if (~np.isnan(label)).any():
        columns["label"] = pa.array(label, pa.float32(), from_pandas=True).cast(pa.int8())
        known = ~np.isnan(label)
        summary["auc"] = auc(label[known], probability[known])
    out.parent.mkdir(parents=True, exist_ok=True)
    write_table(pa.table(columns), out)
    return summary
