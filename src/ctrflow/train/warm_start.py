"""Warm start (`ctrflow train --init-from CKPT`): a new run that begins from a checkpoint's weights and
optimizer state, on data whose vocabularies extend the checkpoint's (`ctrflow preprocess --vocab-from`).

It is a resume that maps smaller tables into larger ones and starts afresh in position: step, epoch,
the learning-rate schedule, the metrics log and the random generators are the new run's (its own
`--seed`). Tables grow at the end (`ctrflow.checkpoint.growth`): old rows as trained, new rows as a fresh
model of the new size draws them (`init_rows`), their optimizer state zero. The dense weights, the
output bias included, and the dense optimizer's state (with its bias-correction step counts: the
moments carry on, they are not restarted) are the checkpoint's. Any process count and path (plain,
fused, sharded) loads any checkpoint, as a resume does: whole tables by name, one at a time.

Refused with one line naming the difference: a checkpoint of another architecture, data with other
features, or vocabularies that do not extend the checkpoint's (`ctrflow.lineage`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ctrflow import checkpoint
from ctrflow.checkpoint.growth import GrownStates, GrownTables, table_slots
from ctrflow.checkpoint.tables import read_model_state, read_optimizer_state
from ctrflow.config import TrainConfig
from ctrflow.embedding.collection import deferred_tables
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.contract.schema import Schema
from ctrflow.lineage import check_descendant

if TYPE_CHECKING:
    from ctrflow.runtime import Runtime
    from ctrflow.train.optim import Optimizers


def warm_start(model: nn.Module, optimizers: Optimizers, config: TrainConfig, schema: Schema,
               runtime: Runtime) -> Path:
    """Load `config.init_from` into the built `model` and `optimizers` (module doc); returns the step
    directory read. Collective with N processes (every rank calls it)."""
    where = f"--init-from {config.init_from}"
    try:
        step_dir = checkpoint.resolve_checkpoint(config.init_from)
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    meta = checkpoint.read_meta_shared(step_dir, runtime)
    check_descendant(Schema.load(step_dir / "schema.json"), schema, config.data.path, where,
                     meta.get("config", {}).get("data", {}).get("path"))
    check_architecture(meta["model"], config, where)
    m = config.model
    with deferred_tables():  # the tables' sizes and seeds, nothing drawn
        fresh = build_model(m.name, schema, m.embedding_dim, seed=config.seed, **m.arch_kwargs())
    slots = table_slots(fresh)
    state = read_model_state(step_dir, meta)
    checkpoint.load_model_state(model, {"dense": state["dense"], "tables": GrownTables(state["tables"], slots, where)})
    saved = read_optimizer_state(step_dir, meta)
    kinds = optimizers.header()["sparse"].get("kinds", {})
    tables = {slot.table.name: slot.table for slot in slots.values()}
    keys = {name: optimizers.state_keys(name) for name in kinds}
    saved["sparse"] = {**saved["sparse"], "kinds": reconcile_kinds(saved["sparse"], kinds, keys, where),
                       "tables": GrownStates(saved["sparse"].get("tables", {}), tables, keys)}
    optimizers.load_state_dict(saved)
    return step_dir


def check_architecture(trained: dict, config: TrainConfig, where: str) -> None:
    """The checkpoint's model (`meta.json` "model") must be this run's: name, embedding dim, layer
    settings (dropout and the seed may differ: they hold no weights)."""
    wanted = checkpoint.model_meta(config)
    arch = {k: v for k, v in trained.get("arch", {}).items() if k != "dropout"}
    diffs = [f"{k} {trained.get(k)} != {wanted[k]}" for k in ("name", "embedding_dim") if trained.get(k) != wanted[k]]
    diffs += [f"{k} {arch.get(k)} != {v}" for k, v in wanted["arch"].items() if k != "dropout" and arch.get(k) != v]
    if diffs:
        raise UserError(f"{where}: the checkpoint's model differs from this run's: " + "; ".join(diffs))


def reconcile_kinds(saved: dict, kinds: dict[str, str], keys: dict[str, tuple[str, ...]], where: str) -> dict:
    """The checkpoint's table optimizers as this run's `kinds` where their state is the same tensors
    (Adam and LazyAdam both keep two moments; `--sparse-optimizer auto` picks by a table's rows, which
    grow); another kind is a UserError naming the table."""
    out = dict(saved.get("kinds", {}))
    tables = saved.get("tables", {})
    for name, kind in kinds.items():
        before = out.get(name)
        if before is None:
            raise UserError(f"{where}: the checkpoint has no optimizer state for table {name}")
        held = set(tables[name]) if name in tables else set()
        if before != kind and held and held != set(keys[name]):
            raise UserError(f"{where}: table {name} was trained with the {before} optimizer, this run uses {kind} "
                            f"(other state); choose --sparse-optimizer {before}")
        out[name] = kind
    return out
