"""Two gloo ranks on CPU: the sharded collection equals the plain one fed the global batch.

Outputs, weights and optimizer state after several steps, for every sharding type and a mixed
plan; then whole tables and state reloaded into another sharding continue the same trajectory.
The same with multi-hot bags (sum and mean, padding, empty bags) among one-hot tables, against every
slot looked up and pooled by `pool_bags` in one process.
`tests/gpu/test_sharded_nccl.py` runs the same worker with NCCL on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import TableConfig
from bag_fixtures import SlotReference, bag_batches, bag_tables

TABLES = [TableConfig("t_a", 7, 4, "C1"), TableConfig("t_b", 50, 4, "C2"), TableConfig("t_c", 3, 4, "C3")]
PLANS = {
    "table": "table",
    "row": "row",
    "column": "column",
    "data": "data",
    "mixed": {"t_a": "column", "t_b": "row", "t_c": "data"},
}
OPTIMIZERS = {"table": "lazy_adam", "row": "adagrad", "column": "adagrad", "data": "adam", "mixed": "sgd"}
BATCH, STEPS = 8, 3
BAGS = bag_tables(4)
# multi-hot: every sharding type for all tables, and two mixes that put each bag under each type
BAG_PLANS = {"bags-table": ("table", "lazy_adam"), "bags-row": ("row", "adagrad"),
             "bags-column": ("column", "adam"), "bags-data": ("data", "adagrad"),
             "bags-mixed": ({"t_a": "column", "t_g": "row", "t_b": "data", "t_h": "row", "t_c": "table",
                             "t_k": "row"}, "lazy_adam"),
             "bags-mixed-2": ({"t_a": "row", "t_g": "column", "t_b": "table", "t_h": "data", "t_c": "row",
                               "t_k": "table"}, "sgd")}
RESUME = {"t_a": "row", "t_b": "column", "t_c": "table"}  # another sharding, to resume in
BAG_RESUME = {"t_a": "row", "t_g": "table", "t_b": "column", "t_h": "column", "t_c": "data", "t_k": "row"}


class Probe(torch.nn.Module):
    """A fixed nonlinear readout of the embeddings, so every row's gradient differs."""

    def __init__(self, embeddings, tables: int = 3):
        super().__init__()
        self.embeddings = embeddings
        self.register_buffer("readout", torch.linspace(-1.0, 1.0, tables * 4).view(tables, 4))

    def forward(self, ids):
        out = self.embeddings(ids)  # [b, T, 4]
        return torch.tanh((out * self.readout).sum(-1)).pow(2).sum(-1).mean(), out


def _batches(device):
    gen = torch.Generator().manual_seed(0)
    return [torch.stack([torch.randint(0, t.num_embeddings, (BATCH,), generator=gen) for t in TABLES], 1).to(device)
            for _ in range(STEPS)]


def _train(model, optimizer, batches, rank, world):
    outputs = []
    b = BATCH // world
    for ids in batches:
        loss, out = model(ids[rank * b:(rank + 1) * b])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        outputs.append(out.detach().cpu())
    return outputs


def _max_diff(a: dict, b: dict) -> float:
    return max([float((a[k].cpu() - b[k].cpu()).abs().max()) for k in b] + [0.0])


def _compare(spec, kind, rank, world, batches, device, tables=TABLES, resume=RESUME) -> dict:
    """Train the plain collection (multi-hot tables: `SlotReference`) on the global batches and a
    sharded one on this rank's slices."""
    reference = EmbeddingCollection(tables, seed=3) if tables is TABLES else SlotReference(tables, seed=3)
    plain = Probe(reference, len(tables)).to(device)
    plain_opt = SparseOptimizer(plain, kind, lr=0.1)
    ref_out = _train(plain, plain_opt, batches, 0, 1)
    overrides = spec if isinstance(spec, dict) else None
    plan = plan_sharding(tables, world, "auto" if overrides else spec, overrides=overrides)
    model = Probe(ShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=3), plan,
                                                             device=device), len(tables)).to(device)
    opt = SparseOptimizer(model, kind, lr=0.1)
    out = _train(model, opt, batches, rank, world)
    got, state = model.embeddings.full_weights(), opt.state_dict()
    resumed = _resume_elsewhere(got, state, kind, rank, world, batches[0], device, tables, resume)
    ref_weights = {k: v.clone() for k, v in plain.embeddings.full_weights().items()}  # a view otherwise
    ref_state = plain_opt.state_dict()
    _train(plain, plain_opt, batches[:1], 0, 1)
    b = BATCH // world
    return {
        "out": max(float((o - r[rank * b:(rank + 1) * b]).abs().max()) for o, r in zip(out, ref_out)),
        "weights": _max_diff(got, ref_weights),
        "state": max([_max_diff(state["tables"][t], ref_state["tables"][t]) for t in ref_state["tables"]]),
        "resumed": _max_diff(resumed, plain.embeddings.full_weights()),
        "plan": [tp.sharding for tp in plan.tables.values()],
    }


def _resume_elsewhere(weights, state, kind, rank, world, batch, device, tables=TABLES, resume=RESUME):
    """Load whole tables and optimizer state into another sharding (a resume on a new topology)
    and take one more step."""
    plan = plan_sharding(tables, world, overrides=resume)
    model = Probe(ShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=9), plan,
                                                             device=device), len(tables)).to(device)
    model.embeddings.load_full_weights(weights)
    opt = SparseOptimizer(model, kind, lr=0.1)
    opt.load_state_dict(state)
    _train(model, opt, [batch], rank, world)
    return model.embeddings.full_weights()


def _forward_with_one_empty_rank(rank, world, batch, device, tables=TABLES, overrides=None):
    """A rank with no samples (a short last batch) still serves the others' lookups."""
    plain = EmbeddingCollection(tables, seed=3)
    reference = plain if tables is TABLES else SlotReference(tables, seed=3)
    plan = plan_sharding(tables, world, overrides=overrides or {"t_a": "row", "t_b": "column", "t_c": "data"})
    sharded = ShardedEmbeddingCollection.from_collection(plain, plan, device=device)
    out = sharded(batch if rank == 0 else batch[:0])
    if rank:
        return out.shape == (0, len(tables), 4)
    expected = reference(batch.cpu()).detach()
    if tables is TABLES:  # one id each: the very rows
        return bool(torch.equal(out.detach().cpu(), expected))
    return float((out.detach().cpu() - expected).abs().max()) < 1e-6


def worker(rank, world, store_path, results, device_type="cpu"):
    """One rank: every plan and optimizer compared with the plain collection; results on rank 0."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        batches = _batches(device)
        for name, spec in PLANS.items():
            result = _compare(spec, OPTIMIZERS[name], rank, world, batches, device)
            if rank == 0:
                results[name] = result
        bags = [ids.to(device) for ids in bag_batches(BAGS, BATCH, STEPS)]
        for name, (spec, kind) in BAG_PLANS.items():
            result = _compare(spec, kind, rank, world, bags, device, BAGS, BAG_RESUME)
            if rank == 0:
                results[name] = result
        empty_ok = _forward_with_one_empty_rank(rank, world, batches[0], device)
        empty_ok &= _forward_with_one_empty_rank(rank, world, bags[0], device, BAGS, BAG_PLANS["bags-mixed"][0])
        if rank == 0:
            results["empty_ok"] = empty_ok
    finally:
        dist.destroy_process_group()


def check_results(results, tolerance: float) -> None:
    """Every comparison within `tolerance`, every plan as asked."""
    assert results.pop("empty_ok") is True
    assert set(results) == {*PLANS, *BAG_PLANS}
    for name, r in results.items():
        for key in ("out", "weights", "state", "resumed"):
            assert r[key] < tolerance, (name, key, r)
    assert results["mixed"]["plan"] == ["column", "row", "data"]
    assert results["bags-mixed"]["plan"] == ["column", "row", "data", "row", "table", "row"]
    assert results["bags-column"]["plan"] == ["column"] * 6


def test_two_ranks_match_plain_collection_for_every_sharding(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    check_results(dict(results), 1e-6)
