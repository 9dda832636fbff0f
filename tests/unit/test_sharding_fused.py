"""Two gloo ranks on CPU: the fused sharded collection (the fused kernels' torch version here) equals
the fused one-process collection fed the global batch: outputs, tables and optimizer state after
several steps, for table-, row- and data-parallel plans and a mixed one, with each fused optimizer.
The same with multi-hot bags (sum and mean, padding, empty bags) among one-hot tables, against one
fused process that looks every slot up and pools it by `pool_bags` (also as micro-batches, and with
the next step's ids routed ahead).
`tests/gpu/test_sharded_nccl.py` runs the same worker with NCCL and the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.tables import TableConfig
from ctrflow.features import Features
from bag_fixtures import FusedSlotReference, bag_batches, bag_tables

MIXED = {"t_a": "table", "t_b": "row", "t_c": "data", "t_d": "row"}
# name -> (plan, optimizer, micro-batches per step: `prefetch`ed chunks, one update for all of them)
PLANS = {"table": ("table", "adam", 1), "row": ("row", "rowwise_adagrad", 1), "data": ("data", "adam", 1),
         "mixed": (MIXED, "sgd", 1), "mixed-chunked": (MIXED, "adam", 2), "row-chunked": ("row", "rowwise_adagrad", 3)}
KEYS = {"sgd": {}, "rowwise_adagrad": {"sum": "state1"}, "adam": {"exp_avg": "state1", "exp_avg_sq": "state2"}}
BAG_MIXED = {"t_a": "table", "t_g": "row", "t_b": "data", "t_h": "row", "t_c": "table", "t_k": "data"}
BAG_MIXED_2 = {"t_a": "row", "t_g": "table", "t_b": "table", "t_h": "data", "t_c": "row", "t_k": "row"}
STATIC = {"t_a": "data", "t_g": "table", "t_b": "table", "t_h": "data", "t_c": "table", "t_k": "table"}
# multi-hot: name -> (plan, optimizer, micro-batches, next step's ids routed ahead)
BAG_PLANS = {"bags-table": ("table", "adam", 1, False), "bags-row": ("row", "rowwise_adagrad", 1, False),
             "bags-data": ("data", "adam", 1, False), "bags-mixed": (BAG_MIXED, "sgd", 1, False),
             "bags-mixed-chunked": (BAG_MIXED, "adam", 2, False), "bags-row-chunked": ("row", "rowwise_adagrad", 3, False),
             "bags-mixed-2": (BAG_MIXED_2, "rowwise_adagrad", 1, False), "bags-ahead": (STATIC, "adam", 1, True)}


def tables(dim: int, scale: int = 1) -> list[TableConfig]:
    """Four tables of `dim` (one tiny, one with fewer rows than some batches' ids)."""
    sizes = [7 * scale, 50 * scale, 3, 23 * scale]
    return [TableConfig(f"t_{c}", n, dim, f"C{i + 1}") for i, (c, n) in enumerate(zip("abcd", sizes))]


class Probe(torch.nn.Module):
    """A fixed nonlinear readout of the embeddings, so every row's gradient differs."""

    def __init__(self, embeddings, features: int, dim: int):
        super().__init__()
        self.embeddings = embeddings
        self.register_buffer("readout", torch.linspace(-1.0, 1.0, features * dim).view(features, dim))

    def forward(self, ids, chunks: int = 1):
        if chunks > 1:  # every chunk's exchange started first, as `forward_in_chunks` does
            parts = list(ids.chunk(chunks))
            self.embeddings.prefetch(parts)
            out = torch.cat([self.embeddings(p) for p in parts])
        else:
            out = self.embeddings(ids)  # [b, F, D]
        return torch.tanh((out.float() * self.readout).sum(-1)).pow(2).sum(-1).mean(), out


def _run(model, batches, rank, world, chunks=1, ahead=False) -> tuple[list[torch.Tensor], list[float]]:
    """Train on this rank's slice of each batch: (outputs, global-batch losses: the ranks' mean);
    `ahead`: each step's lookups started with the next step's ids (`prefetch(next_ids=...)`)."""
    outs, losses = [], []
    b = batches[0].shape[0] // world
    for i, ids in enumerate(batches):
        mine = ids[rank * b:(rank + 1) * b]
        if ahead:
            following = batches[i + 1][rank * b:(rank + 1) * b] if i + 1 < len(batches) else None
            model.embeddings.prefetch([mine], next_ids=following)
        loss, out = model(mine, chunks)
        loss.backward()
        outs.append(out.detach().float().cpu())
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return outs, losses


def _diff(a: dict, b: dict) -> float:
    return max([float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in b] + [0.0])


def compare(spec, optimizer, rank, world, device, dim=4, batch=16, steps=4, scale=1, dtype=torch.float32, lr=0.1,
            chunks=1, bags=False, ahead=False):
    """Max differences (outputs, tables, state) of the sharded collection against one process
    (`bags`: with multi-hot tables, against `FusedSlotReference`)."""
    tabs = bag_tables(dim, scale) if bags else tables(dim, scale)
    gen = torch.Generator().manual_seed(0)
    batches = ([ids.to(device) for ids in bag_batches(tabs, batch, steps)] if bags else
               [torch.stack([torch.randint(0, t.num_embeddings, (batch,), generator=gen) for t in tabs], 1).to(device)
                for _ in range(steps)])
    opts = dict(optimizer=optimizer, lr=lr, output_dtype=dtype)
    reference = (FusedSlotReference(tabs, 3, device, **opts) if bags else
                 FusedEmbeddingCollection.from_collection(EmbeddingCollection(tabs, seed=3), device=device, **opts))
    ref = Probe(reference, len(tabs), dim).to(device)
    ref_out, ref_loss = _run(ref, batches, 0, 1)
    overrides = spec if isinstance(spec, dict) else None
    plan = plan_sharding(tabs, world, "auto" if overrides else spec, overrides=overrides)
    sharded = FusedShardedEmbeddingCollection.from_collection(EmbeddingCollection(tabs, seed=3), plan, device=device,
                                                              **opts)
    model = Probe(sharded, len(tabs), dim).to(device)
    out, loss = _run(model, batches, rank, world, chunks, ahead)
    b = batch // world
    keys = KEYS[optimizer]
    got_state, ref_state = sharded.table_states(keys), ref.embeddings.table_states(keys)
    return {"out": max(float((o - r[rank * b:(rank + 1) * b]).abs().max()) for o, r in zip(out, ref_out)),
            "loss": max(abs(a - e) / abs(e) for a, e in zip(loss, ref_loss)),
            "weights": _diff(sharded.full_weights(), ref.embeddings.full_weights()),
            "state": max([_diff(got_state[t], ref_state[t]) for t in ref_state] + [0.0]),
            "plan": [tp.sharding for tp in plan.tables.values()],
            "in_place": sharded.exchange_rows() is not None, "sizes": _static_sizes(sharded, batches[0], world)}


def _static_sizes(sharded, ids: torch.Tensor, world: int) -> bool | None:
    """Whether a static plan's all-to-all sizes follow from b and the tables alone: a whole table's
    ids [b, length] each way out, one vector per (sample, table) back (None for row-wise plans)."""
    lay = sharded.layout
    if not lay.static or not sharded.model_parallel:
        return None
    b = ids.shape[0] // world
    with torch.no_grad():
        sharded.prefetch([ids[:b]])
    entry = sharded.ready.pop(0)
    if entry["work"] is not None:
        entry["work"].wait()
    r = entry["route"]
    slots = [sum(sharded.tables[f].length for f in lay.tab[d]) for d in range(world)]
    return (r.send == [b * n for n in slots] and r.recv == [b * slots[lay.rank]] * world
            and r.back_in == [b * len(lay.tab[d]) for d in range(world)]
            and r.back_out == [b * len(lay.tab[lay.rank])] * world)


def train_dlrm(rank, world, device, dim, chunks, in_place, deferred=False, steps=3, batch=24, ahead=False):
    """DLRM with fused sharded tables (two whole, the rest replicated), Adam, `steps` steps on this
    rank's slice of each batch: (last logits, whole tables). Dense weights stay put. `deferred`:
    the tables update at an explicit `flush()` after backward instead of inside it; `ahead`: each
    step routes the next step's ids (`next_ids`)."""
    from ctrflow.embedding.fused.interaction import FusedDotInteraction
    from ctrflow.embedding.fused.sharded_model import forward_in_chunks, read_exchange_layout
    from ctrflow.models import build_model, replace_module

    sizes = [5 + 3 * i for i in range(26)]
    gen = torch.Generator().manual_seed(2)
    model = build_model("dlrm", Features.categorical(sizes, 13), dim, seed=1)
    plan = plan_sharding(model.embeddings.tables, world, "auto", overrides={"t_C1": "table", "t_C9": "table"})
    model.embeddings = FusedShardedEmbeddingCollection.from_collection(model.embeddings, plan, device=device,
                                                                       optimizer="adam", lr=0.05)
    replace_module(model, "interaction", FusedDotInteraction.from_plain(model.interaction))
    model.to(device)
    if in_place:
        assert read_exchange_layout(model)
    model.embeddings.update_in_backward = not deferred
    batches = []
    for _ in range(steps):
        dense = torch.rand(batch * world, 13, generator=gen)[rank * batch:(rank + 1) * batch].to(device)
        ids = torch.stack([torch.randint(0, n, (batch * world,), generator=gen) for n in sizes], 1)
        labels = torch.randint(0, 2, (batch * world,), generator=gen).float()
        batches.append((dense, ids[rank * batch:(rank + 1) * batch].to(device), labels))
    for i, (dense, ids, labels) in enumerate(batches):
        next_ids = batches[i + 1][1] if ahead and i + 1 < steps else None
        logits = forward_in_chunks(model, dense, ids, chunks, next_ids)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rank * batch:(rank + 1) * batch]
                                                             .to(device)).backward()
        if deferred:
            model.embeddings.flush()
    return logits.detach().float().cpu(), model.embeddings.full_weights()


def compare_dlrm(rank, world, device, dim) -> dict:
    """Max differences of micro-batched, in-place-layout and routed-ahead DLRM steps against the plain step."""
    ref_out, ref_weights = train_dlrm(rank, world, device, dim, 1, False)
    out, weights = 0.0, 0.0
    for chunks, in_place, deferred, ahead in ((3, False, False, False), (3, True, False, False),
                                              (1, True, True, False), (1, True, True, True), (1, False, False, True)):
        got_out, got_weights = train_dlrm(rank, world, device, dim, chunks, in_place, deferred, ahead=ahead)
        out = max(out, float((got_out - ref_out).abs().max()))
        weights = max(weights, _diff(got_weights, ref_weights))
    return {"out": out, "loss": 0.0, "weights": weights, "state": 0.0}


def worker(rank, world, store_path, results, device_type="cpu", dim=4, scale=1, steps=4, lr=0.1):
    """One rank: every plan compared with the one-process collection; results on rank 0."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world)
    try:
        for name, (spec, optimizer, chunks) in PLANS.items():
            result = compare(spec, optimizer, rank, world, device, dim=dim, scale=scale, steps=steps,
                             batch=16 * scale, lr=lr, chunks=chunks)
            if rank == 0:
                results[name] = result
        for name, (spec, optimizer, chunks, ahead) in BAG_PLANS.items():
            result = compare(spec, optimizer, rank, world, device, dim=dim, scale=scale, steps=steps,
                             batch=16 * scale, lr=lr, chunks=chunks, bags=True, ahead=ahead)
            if rank == 0:
                results[name] = result
        result = compare_dlrm(rank, world, device, max(dim, 16))  # the interaction's kernels need D >= 16
        if rank == 0:
            results["dlrm"] = result
    finally:
        dist.destroy_process_group()


def check(results: dict, tolerance: float) -> None:
    """Every comparison within `tolerance`; the mixed plans as asked; multi-hot collections never
    let the interaction read the exchange in place; static plans' sizes as one-hot ones' (per table)."""
    assert set(results) == {*PLANS, "dlrm", *BAG_PLANS}
    for name, r in results.items():
        for key in ("out", "loss", "weights", "state"):
            assert r[key] < tolerance, (name, key, r)
    assert results["mixed"]["plan"] == results["mixed-chunked"]["plan"] == ["table", "row", "data", "row"]
    assert results["bags-mixed"]["plan"] == ["table", "row", "data", "row", "table", "data"]
    assert results["table"]["in_place"] and not any(r["in_place"] for n, r in results.items() if n.startswith("bags"))
    for name in ("table", "data", "bags-table", "bags-data", "bags-ahead"):
        assert results[name]["sizes"] in (True, None), name
    assert results["bags-table"]["sizes"] is True and results["bags-ahead"]["sizes"] is True


def test_two_ranks_match_the_fused_collection_on_the_global_batch(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    check(dict(results), 1e-6)


def test_replicated_gradient_counts_every_touch_of_a_large_table():
    from ctrflow.embedding.fused.replicas import replicated_grad

    rows, dim = 80_003, 2  # large enough that float bin arithmetic (histc) misplaces ids
    ids = torch.randint(0, rows, (4096, 1), generator=torch.Generator().manual_seed(1))
    grad = torch.ones(4096, 1, dim)
    acc = replicated_grad(ids, torch.zeros(1, dtype=torch.int64), grad, rows, {})
    expected = torch.bincount(ids.reshape(-1), minlength=rows).float()
    assert torch.equal(acc[rows * dim:], expected)
    assert torch.equal(acc[:rows * dim].view(rows, dim)[:, 0], expected)


def test_dlrm_step_in_chunks_equals_the_whole_batch_step():
    """One process: micro-batches (one update for all), the interaction reading the exchange
    buffers in place and the next step's ids routed ahead train DLRM as the whole batch does."""
    r = compare_dlrm(0, 1, torch.device("cpu"), dim=8)
    assert r["out"] < 1e-6 and r["weights"] < 1e-6, r
