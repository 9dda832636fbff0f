"""Preprocessing fanned out per input file, for many machines (KFP `ParallelFor`): count → merge →
transform → finalize, giving exactly what one `preprocess` call gives.

- `count_file`: one file's fit pass → COUNTS_DIR (sorted run files, other-string counts, per-block
  row records, the file's accounting and content digest).
- `merge_counts`: every COUNTS_DIR → MERGED_DIR (vocab/, and merge.json: each file's first Parquet part
  number per split, so parts are numbered as one process numbers them); `--vocab-from` grows an earlier
  output's vocabularies here (`growth`), and merge.json carries the parent on to `finalize`.
- `transform_file`: one file, parsed again → PARTS_DIR/{train,valid}/part-NNNNN.parquet.
- `finalize`: vocab + every PARTS_DIR + the counts → the dataset (schema.json, stats.json, metadata),
  published atomically.
A file is named by its index in the input order (`file_index`: train files first, then valid): it
seeds the `--valid-fraction` coin and orders the parts, as in the single-process run. The per-file
steps run the CPU engine's passes, whatever engine the single-process run would use. Only `count`
is told the dataset (`--dataset criteo|FILE`); its description travels on in counts.json and
merge.json, so the later steps read the files as `count` did.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ctrflow.ingest.datasets import dataset_from_dict, open_dataset
from ctrflow.errors import UserError
from ctrflow.ingest.accounting import collect_stats, file_stats
from ctrflow.ingest.counting import SPILL_ENTRIES
from ctrflow.contract.formats.files import expand_inputs
from ctrflow.ingest.output import check_out_dir, file_digest, publish
from ctrflow.ingest.run import (DEFAULT_COMPRESSION, RANGE_ENTRIES, RECORD_KEYS, build_vocabulary, fit_pass,
                                open_grown, transform_pass, write_metadata)
from ctrflow.contract.vocab import write_vocab

COUNTS, OTHER, MERGE, PARTS = "counts.json", "other.arrow", "merge.json", "parts.json"
_SPLITS = ("train", "valid")


def _one_file(input: str | os.PathLike) -> Path:
    paths = expand_inputs([input])
    if len(paths) != 1:
        raise UserError(f"{input}: matches {len(paths)} files; the per-file steps take exactly one")
    return paths[0]


def _split_kind(split: str, valid_fraction: float | None) -> str:
    if split not in _SPLITS:
        raise UserError(f"--split must be 'train' or 'valid', got {split!r}")
    if valid_fraction and split == "valid":
        raise UserError("--valid-fraction applies to training files only")
    return "split" if valid_fraction else split


def _fit_file(data, path: Path, kind: str, index: int, work: Path, count: bool, **options):
    """The single-process fit pass on one file: (records, per-file stats, warnings, worker finals)."""
    fit = data.fit_stage({index: str(path)}, {index: kind}, str(work / "cache") if not count else "",
                         options["valid_fraction"] or 0.0, options["seed"],
                         stop_at_bad_row=options["on_bad_rows"] == "error", run_dir=str(work / "runs"),
                         spill_entries=options.get("spill_entries", SPILL_ENTRIES), count=count)
    per_file, warnings = {index: file_stats(path, kind)}, []
    try:
        records, finals = fit_pass(data, fit, [(index, (path, kind))], work, options["workers"],
                                   options["chunk_rows"], False, per_file, warnings)
    finally:
        shutil.rmtree(work / "runs" / "inputs", ignore_errors=True)  # decompressed copies of gzip tables
    stats = {k: v for k, v in per_file[index].items() if not k.startswith("_")}
    return records, stats, warnings, finals


def _dataset_kind(data) -> str:
    return "criteo" if "gpu" in data.engines else "table"


def count_file(input: str | os.PathLike, out: str | os.PathLike, file_index: int = 0, split: str = "train",
               valid_fraction: float | None = None, seed: int = 0, chunk_rows: int | None = None,
               on_bad_rows: str = "error", workers: int = 1, spill_entries: int = SPILL_ENTRIES,
               dataset="criteo") -> dict:
    """Count one training (or validation) file's values into `out`; returns its accounting. `dataset`:
    "criteo" or a description file (recorded in `out/counts.json` for the later steps)."""
    data = open_dataset(dataset)
    path, kind, out = _one_file(input), _split_kind(split, valid_fraction), Path(out)
    data.check_inputs([path])
    (out / "runs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    chunk_rows = data.chunk_rows(chunk_rows)
    records, stats, warnings, finals = _fit_file(data, path, kind, file_index, out, True,
                                                 valid_fraction=valid_fraction, seed=seed, on_bad_rows=on_bad_rows,
                                                 workers=workers, chunk_rows=chunk_rows, spill_entries=spill_entries)
    runs = []
    for i, run in enumerate(r for final in finals for r in final["runs"]):
        runs.append(f"runs/run-{i:05d}.arrow")
        os.replace(run, out / runs[-1])
    _write_other(out / OTHER, finals)
    summary = {"file_index": file_index, "path": str(path.resolve()), "split": kind,
               "digest": file_digest(path, workers), "stats": stats, "warnings": warnings, "runs": runs,
               "chunk_rows": chunk_rows,
               "dataset": data.description.to_dict(), "dataset_kind": _dataset_kind(data),
               "records": [_record_json(r) for r in records], "seconds": round(time.perf_counter() - started, 3)}
    (out / COUNTS).write_text(json.dumps(summary) + "\n")
    return summary


def _record_json(record: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in record.items() if k in RECORD_KEYS}


def _write_other(path: Path, finals: list[dict]) -> None:
    """Other-string counts of every column in one table (column, value, count)."""
    names, values, counts = [], [], []
    for final in finals:
        for name, (other, other_counts) in final["other"].items():
            names.append(pa.array([name] * len(other), pa.string()))
            values.append(other)
            counts.append(other_counts)
    empty = [pa.array([], pa.string())]
    pq.write_table(pa.table({"column": pa.concat_arrays(names or empty), "value": pa.concat_arrays(values or empty),
                             "count": pa.concat_arrays(counts or [pa.array([], pa.int64())])}), path)


def _read_counts(count_dirs) -> list[tuple[Path, dict]]:
    found = []
    for directory in map(Path, count_dirs):
        if not (directory / COUNTS).exists():
            raise UserError(f"{directory}: no {COUNTS} (is it a `ctrflow preprocess count` output?)")
        found.append((directory, json.loads((directory / COUNTS).read_text())))
    found.sort(key=lambda item: item[1]["file_index"])
    indexes = [c["file_index"] for _, c in found]
    if len(set(indexes)) != len(indexes):
        raise UserError(f"two count directories have the same --file-index ({sorted(indexes)})")
    described = {json.dumps(c.get("dataset"), sort_keys=True) for _, c in found}
    if len(described) > 1:
        raise UserError("the count directories were made with different --dataset descriptions")
    return found


def merge_counts(count_dirs, out: str | os.PathLike, freq_threshold: int | None = None, workers: int = 1,
                 range_entries: int = RANGE_ENTRIES, vocab_from: str | os.PathLike | None = None) -> dict:
    """Merge every file's counts into the vocabularies (`out/vocab/`) and the part numbering (`out/merge.json`).
    `freq_threshold`: the default threshold (None: the description's); `vocab_from`: an earlier output
    whose vocabularies grow (`ctrflow.ingest.growth`; recorded in merge.json, then schema.json)."""
    found, out = _read_counts(count_dirs), Path(out)
    data = _dataset_of(found[0][1], freq_threshold)
    previous = None
    if vocab_from is not None:
        previous = open_grown(data, vocab_from)
    started = time.perf_counter()
    finals = []
    names = data.description.sparse
    for directory, counts in found:
        other = pq.read_table(directory / OTHER)
        by_column = {}
        for name in names:
            rows = other.filter(pc.equal(other.column("column"), name))
            by_column[name] = (rows.column("value").combine_chunks(), rows.column("count").combine_chunks())
        finals.append({"runs": [str(directory / run) for run in counts["runs"]], "other": by_column})
    data.settle([r for _, counts in found for r in counts["records"]], [])
    tables, distinct = build_vocabulary(data, finals, workers, range_entries, remove=False,
                                        previous=str(previous.path) if previous else "")
    out.mkdir(parents=True, exist_ok=True)
    write_vocab(out, tables)
    first_parts, next_part = {}, {split: 0 for split in _SPLITS}
    for _, counts in found:  # as `preprocess` numbers them: blocks with rows, in input order
        first_parts[str(counts["file_index"])] = dict(next_part)
        for record in counts["records"]:
            for split in _SPLITS:
                next_part[split] += bool(record["cache"] is not None and record["rows"][split])
    blocks = {str(c["file_index"]): _block_rows(c["records"]) for _, c in found}
    merged = {"freq_threshold": data.description.default_threshold, "distinct": distinct,
              "first_parts": first_parts, "blocks": blocks, "parts": next_part,
              "files": [c["file_index"] for _, c in found], "dataset": data.description.to_dict(),
              "dataset_kind": _dataset_kind(data), "seconds": round(time.perf_counter() - started, 3)}
    if previous is not None:
        merged["parent"] = previous.parent()
    (out / MERGE).write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def _dataset_of(saved: dict, freq_threshold: int | None = None):
    """The dataset a count or merge step recorded (counts before `--dataset` existed: Criteo)."""
    if "dataset" not in saved:
        return open_dataset("criteo", freq_threshold)
    return dataset_from_dict(saved["dataset"], saved.get("dataset_kind", "table"), freq_threshold)


def _block_rows(records: list[dict]) -> list[list[int]]:
    """[train rows, valid rows] per block: what the transform of a file must find again."""
    return [[r["rows"]["train"], r["rows"]["valid"]] for r in records]


def transform_file(input: str | os.PathLike, merged: str | os.PathLike, out: str | os.PathLike, file_index: int = 0,
                   split: str = "train", valid_fraction: float | None = None, seed: int = 0,
                   chunk_rows: int | None = None, on_bad_rows: str = "error", workers: int = 1,
                   compression: str = DEFAULT_COMPRESSION) -> dict:
    """One file → `out/{train,valid}/part-NNNNN.parquet`, numbered from `merged/merge.json`."""
    path, kind, out, merged = _one_file(input), _split_kind(split, valid_fraction), Path(out), Path(merged)
    if not (merged / MERGE).exists():
        raise UserError(f"{merged}: no {MERGE} (is it a `ctrflow preprocess merge` output?)")
    plan = json.loads((merged / MERGE).read_text())
    if str(file_index) not in plan["first_parts"]:
        raise UserError(f"--file-index {file_index} was not counted (merged: {plan['files']})")
    started = time.perf_counter()
    work = out / ".work"
    for sub in ("cache", "runs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    for split_name in _SPLITS:
        (work / split_name).mkdir(exist_ok=True)
    data = _dataset_of(plan)
    data.check_inputs([path])
    chunk_rows = data.chunk_rows(chunk_rows)
    records, _, _, _ = _fit_file(data, path, kind, file_index, work, False, valid_fraction=valid_fraction, seed=seed,
                                 on_bad_rows=on_bad_rows, workers=workers, chunk_rows=chunk_rows)
    if _block_rows(records) != plan["blocks"][str(file_index)]:
        raise UserError(f"{path}: its blocks differ from what `count` saw (another --chunk-rows, --valid-fraction, "
                        "--seed or --split, or a changed file?)")
    rows = transform_pass(data, records, work, compression, workers, False, plan["first_parts"][str(file_index)],
                          str(merged))
    for split_name in _SPLITS:
        (out / split_name).mkdir(parents=True, exist_ok=True)
        for part in sorted((work / split_name).glob("part-*.parquet")):
            os.replace(part, out / split_name / part.name)
    shutil.rmtree(work)
    result = {"file_index": file_index, "rows": rows, "seconds": round(time.perf_counter() - started, 3)}
    (out / PARTS).write_text(json.dumps(result) + "\n")
    return result


def finalize(out: str | os.PathLike, count_dirs, merged: str | os.PathLike, part_dirs) -> dict:
    """Assemble the dataset at `out` from the vocabulary, every file's parts and counts (atomically)."""
    found, merged, out = _read_counts(count_dirs), Path(merged), Path(out)
    plan = json.loads((merged / MERGE).read_text())
    check_out_dir(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        shutil.copytree(merged / "vocab", tmp / "vocab")
        for split in _SPLITS:
            (tmp / split).mkdir()
            for directory in map(Path, part_dirs):
                for part in sorted((directory / split).glob("part-*.parquet")):
                    if (tmp / split / part.name).exists():
                        raise UserError(f"{part}: two transform outputs hold {split}/{part.name}")
                    shutil.copy2(part, tmp / split / part.name)
        for split in _SPLITS:
            found_parts = len(list((tmp / split).glob("part-*.parquet")))
            if found_parts != plan["parts"][split]:
                raise UserError(f"expected {plan['parts'][split]} {split} parts, found {found_parts} "
                                "(is a transform output missing from --parts?)")
        data = _dataset_of(plan)
        stats, files, digests = _stats(data, found, merged, plan, part_dirs)
        _gather_rejected(found, tmp)
        schema = write_metadata(tmp, out, files, digests, stats, data, plan.get("parent"))
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "rows": schema.rows, "cardinalities": schema.cardinalities,
            "vocab_hash": schema.vocab_hash}


def _stats(data, found, merged: Path, plan: dict, part_dirs) -> tuple[dict, list, list[str]]:
    """stats.json as `preprocess` writes it, from the per-file counts (pass times summed over files)."""
    records = [{**r, "missing": np.asarray(r["missing"], dtype=np.int64)} for _, counts in found
               for r in counts["records"]]
    tables = {name: pq.read_table(merged / "vocab" / f"{name}.parquet") for name in data.description.sparse}
    rows = {split: sum(r["rows"][split] for r in records) for split in _SPLITS}
    transforms = [json.loads((Path(d) / PARTS).read_text()) for d in part_dirs if (Path(d) / PARTS).exists()]
    passes = {"fit_seconds": round(sum(c["seconds"] for _, c in found), 3), "vocab_seconds": plan["seconds"],
              "transform_seconds": round(sum(t["seconds"] for t in transforms), 3)}
    warnings = [w for _, counts in found for w in counts["warnings"]]
    data.settle(records, warnings)
    per_file = [counts["stats"] for _, counts in found]
    stats = collect_stats(records, per_file, plan["distinct"], tables, rows, warnings, passes, len(found),
                          found[0][1]["chunk_rows"] if found else data.chunk_rows(None), data.description.dense,
                          data.description.sparse, data.max_lengths, data.truncated)
    stats["passes"]["total_seconds"] = round(sum(passes.values()), 3)
    files = [(Path(c["path"]), c["split"]) for _, c in found]
    return stats, files, [c["digest"] for _, c in found]


def _gather_rejected(found, tmp: Path) -> None:
    """The files' rejected rows, in input order, as one `rejected.tsv` (skip mode only)."""
    sources = [d / "rejected.tsv" for d, _ in found if (d / "rejected.tsv").exists()]
    if not sources:
        return
    with open(tmp / "rejected.tsv", "w", encoding="utf-8") as sink:
        sink.write("file\tline\treason\traw\n")
        for source in sources:
            sink.writelines(source.read_text(encoding="utf-8").splitlines(keepends=True)[1:])
