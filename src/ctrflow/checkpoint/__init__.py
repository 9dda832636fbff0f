"""Topology-independent checkpoints: whole tables by name, dense weights, optimizer state,
position and RNG, written atomically with sha256 checksums.

Layout of a checkpoint directory `CKPT/`:
    schema.json  config.json  metrics.jsonl  latest  best   (each holds a step name, e.g. "step_00000097")
    step_00000097/  dense.pt  optimizer.pt  rng.pt  schema.json  meta.json
                    tables/<path>.<table>.pt  table_state/<table>.<key>.pt   (`ctrflow.checkpoint.tables`)
`dense.pt` holds the dense weights; `optimizer.pt` the dense optimizer's state and the sparse one's
step count, lr and kinds; each table and each of its state tensors has a file of its own, written
one at a time so rank 0 never holds the whole model (format 2). `meta.json` records step, epoch,
batch index, the model's name and architecture, the config asked for, the config resolved (every
`auto` as the run chose it) and the run plan, the table files and each file's sha256. A step
directory is written under a temporary name and renamed when complete.
`latest` names the last step written (what `--resume` continues from); `best` the step of the best
validation AUC so far (what evaluate, export and predict read by default; never pruned), when the run
validated. `resolve_checkpoint(CKPT)` gives the best, `resolve_checkpoint(CKPT, pick="last")` the last.
Format 1 (one `model.pt` with every table, one `optimizer.pt` with every table's state) still reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ctrflow.config import TrainConfig
from ctrflow.errors import UserError
from ctrflow.models import build_model, embedding_collections
from ctrflow.contract.schema import Schema
from ctrflow.checkpoint.tables import (OptimizerState, read_model_state, read_optimizer_state, save_hashed,
                                      write_tables)

if TYPE_CHECKING:  # a type only: reading (serving, predict) starts no process group
    from ctrflow.runtime import Runtime

FORMAT = 2


def model_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """`{"tables": {"embeddings.t_C1": [rows, D], ...}, "dense": state_dict without tables}` on CPU.

    Collective when a collection is sharded: every process must call it.
    """
    tables: dict[str, torch.Tensor] = {}
    paths = embedding_collections(model)
    for path, collection in paths.items():
        for name, weight in collection.full_weights().items():
            tables[f"{path}.{name}"] = weight.detach().cpu()
    return {"tables": tables, "dense": dense_state(model)}


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict without its embedding collections, on CPU (small)."""
    paths = embedding_collections(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()
            if not any(k.startswith(p + ".") for p in paths)}


class _CheckedTables(Mapping):
    """One collection's view of a checkpoint's tables (`{"<path>.<table>": tensor}`, a dict or
    files mapped on demand): by table name, each checked against the model's config when taken,
    so a collection that loads table by table maps one file at a time."""

    def __init__(self, saved: Mapping, path: str, collection: nn.Module):
        self.saved, self.path = saved, path
        self.configs = {t.name: t for t in collection.tables}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.configs[name]  # names and shapes from the configs: no whole table is gathered
        saved = self.saved.get(f"{self.path}.{name}")
        if saved is None:
            raise UserError(f"checkpoint has no table {self.path}.{name}")
        if tuple(saved.shape) != (t.num_embeddings, t.embedding_dim):
            raise UserError(f"table {self.path}.{name}: checkpoint shape {tuple(saved.shape)} "
                            f"!= model {(t.num_embeddings, t.embedding_dim)}")
        return saved

    def __iter__(self) -> Iterator[str]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Inverse of `model_state`, for any sharding of `model`; names what does not fit.
    `state["tables"]` may be a dict or `tables.TableFiles` (mapped one at a time)."""
    paths = embedding_collections(model)
    for path, collection in paths.items():
        tables = _CheckedTables(state["tables"], path, collection)
        if hasattr(collection, "load_full_weights"):  # a sharded collection keeps only its shards
            collection.load_full_weights(tables)
        else:
            with torch.no_grad():
                for name in tables:
                    collection.weights[name].copy_(tables[name])
    result = model.load_state_dict(state["dense"], strict=False)
    missing = [k for k in result.missing_keys if not any(k.startswith(p + ".") for p in paths)]
    if missing or result.unexpected_keys:
        raise UserError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                        f"unexpected {result.unexpected_keys[:5]}")


def rng_state() -> dict[str, Any]:
    """Every generator training may draw from (JSON/torch-safe types only)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def sha256(path: Path) -> str:
    """Hex digest of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(out: str | Path, model: nn.Module, optimizers: OptimizerState, position: dict[str, int],
                    config: TrainConfig, schema: Schema, runtime: Runtime, metrics: dict | None = None,
                    run: dict[str, Any] | None = None, best: bool = False) -> Path:
    """Write `out/step_<step>/` atomically and point `out/latest` (and, with `best`, `out/best`) at
    it; returns the step directory.

    `position` is {"step", "epoch", "batch"}: the next step resumes at global batch `batch` of
    `epoch`. `run`: the run's record (`ctrflow.accel.plan.run_record`): its `resolved` config and
    `plan` go into `meta.json` beside the `config` asked for, and its `calibration` (the output bias
    fitted on the validation split: `ctrflow.train.calibration`). Every process calls this (tables may be
    gathered); rank 0 writes.
    """
    out = Path(out)
    final = out / f"step_{position['step']:08d}"
    tmp = None
    if runtime.is_main:
        for stale in out.glob(".tmp-step_*"):  # left by a killed run: never complete, never read
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True)
    # collective, table by table: rank 0 writes each whole table (and state) and drops it
    files, digests = write_tables(model, optimizers, tmp)
    if tmp is not None:
        digests["dense.pt"] = save_hashed(dense_state(model), tmp / "dense.pt")
        digests["optimizer.pt"] = save_hashed(optimizers.header(), tmp / "optimizer.pt")
        digests["rng.pt"] = save_hashed(rng_state(), tmp / "rng.pt")
        schema.save(tmp / "schema.json")
        digests["schema.json"] = sha256(tmp / "schema.json")
        meta = {"format": FORMAT, **position, "model": model_meta(config), "config": config.to_dict(),
                **{k: v for k, v in (run or {}).items() if k in ("resolved", "plan", "calibration")},
                "world_size": runtime.world_size,
                "metrics": metrics or {}, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files, "sha256": digests}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # the same step saved again (end of epoch == last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(out / "latest", final.name + "\n")
        if best:
            _write_atomic(out / BEST, final.name + "\n")
        _prune(out, config.keep_checkpoints)
    if runtime.distributed:  # every rank waits until the step directory is complete
        dist.barrier()
    return final


def model_meta(config: TrainConfig) -> dict[str, Any]:
    """What `load_model` needs to rebuild the architecture (name, dim, arch settings, seed)."""
    m = config.model
    return {"name": m.name, "embedding_dim": m.embedding_dim, "arch": m.arch_kwargs(), "seed": config.seed}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(out: Path, keep: int) -> None:
    """Remove all but the newest `keep` step directories, and never the best one."""
    best = out / BEST
    kept = best.read_text().strip() if best.exists() else None
    steps = sorted(p for p in out.glob("step_*") if p.is_dir() and p.name != kept)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


BEST, LAST = "best", "last"  # `resolve_checkpoint`'s picks of a run directory


def resolve_checkpoint(path: str | Path, pick: str = BEST) -> Path:
    """The step directory `path` means: itself, or in a run directory the one its `best` file names
    (`pick="best"`; the `latest` one when the run never validated) or its `latest` (`pick="last"`)."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    for name in ((BEST, "latest") if pick == BEST else ("latest",)):
        pointer = path / name
        if pointer.exists():
            step_dir = path / pointer.read_text().strip()
            if (step_dir / "meta.json").exists():
                return step_dir
            raise UserError(f"{pointer}: names {step_dir.name}, which is missing or incomplete")
    raise UserError(f"{path}: not a ctrflow checkpoint (no meta.json or latest)")


def best_step(out: str | Path) -> dict[str, Any] | None:
    """`{"checkpoint", "step", "auc"}` of a run directory's best step, or None when it has none."""
    pointer = Path(out) / BEST
    if not pointer.exists():
        return None
    step_dir = Path(out) / pointer.read_text().strip()
    meta = json.loads((step_dir / "meta.json").read_text())
    return {"checkpoint": str(step_dir), "step": meta["step"], "auc": meta.get("metrics", {}).get("auc")}


def read_meta(step_dir: Path, verify: bool = True, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """`meta.json` of a step directory, after checking every file's sha256 (`share` (i, n): only
    every n-th file from the i-th, in name order: the processes of a resume split the reading)."""
    meta = json.loads((step_dir / "meta.json").read_text())
    if meta.get("format", 1) > FORMAT:
        raise UserError(f"{step_dir / 'meta.json'}: checkpoint format {meta['format']} is newer than this "
                        f"ctrflow reads ({FORMAT}); update ctrflow")
    if verify:
        for name in sorted(meta["sha256"])[share[0]::share[1]]:
            digest = meta["sha256"][name]
            if not (step_dir / name).exists():
                raise UserError(f"{step_dir / name}: missing from the checkpoint")
            if sha256(step_dir / name) != digest:
                raise UserError(f"{step_dir / name}: sha256 mismatch (the file is corrupt or was changed)")
    return meta


def check_schema(trained: Schema, data: Schema, what: str) -> None:
    """Refuse data the checkpoint was not trained for, naming the differences."""
    diffs = trained.differences(data)
    if diffs:
        raise UserError(f"{what} does not match the checkpoint's schema: " + "; ".join(diffs[:6])
                        + (f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""))


def restore_checkpoint(path: str | Path, model: nn.Module, optimizers: OptimizerState,
                       restore_rng: bool = True, runtime: Runtime | None = None) -> dict[str, Any]:
    """Load weights, optimizer state and RNG into a built model; returns the meta (position).
    `runtime` of N processes (collective: all call it): they split the checksums' reading."""
    step_dir = resolve_checkpoint(path)
    meta = read_meta_shared(step_dir, runtime)
    # memory-mapped: each process copies only its shards' rows, the page cache is shared between them
    load_model_state(model, read_model_state(step_dir, meta))
    optimizers.load_state_dict(read_optimizer_state(step_dir, meta))
    if restore_rng:
        set_rng_state(torch.load(step_dir / "rng.pt", weights_only=True))
    return meta


def read_meta_shared(step_dir: Path, runtime: Runtime | None) -> dict[str, Any]:
    """`read_meta` with the files' checks split among the processes: each reads its share once,
    instead of every process reading the whole checkpoint (hundreds of GB at the MLPerf shape; the
    loads read only a process's own rows); a bad file seen by any process raises on all of them."""
    if runtime is None or not runtime.distributed:
        return read_meta(step_dir)
    meta, error = None, None
    try:
        meta = read_meta(step_dir, share=(runtime.rank, runtime.world_size))
    except UserError as err:
        error = str(err)
    errors: list[str | None] = [None] * runtime.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first is not None:
        raise UserError(first)
    return meta


def load_model(ckpt_dir: str | Path) -> tuple[nn.Module, Schema, dict[str, Any]]:
    """(model in eval mode on the CPU, the schema it was trained on, meta) for evaluate/export."""
    step_dir = resolve_checkpoint(ckpt_dir)
    meta = read_meta(step_dir)
    schema = Schema.load(step_dir / "schema.json")
    m = meta["model"]
    model = build_model(m["name"], schema, m["embedding_dim"], seed=m.get("seed", 0), **m["arch"])
    load_model_state(model, read_model_state(step_dir, meta))
    return model.eval(), schema, meta
