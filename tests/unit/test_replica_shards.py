"""Two gloo ranks on CPU: replicated tables updated in shards (`replica_update="sharded"`: reduce-scatter,
each rank steps its rows, all-gather for the lookups) train exactly as the all-reduce update (the
default) does, for SGD, row-wise Adagrad and lazy Adam, fp32 and bf16 lookups, beside model-parallel
tables and in micro-batches; whole tables and optimizer state read after training are the trained
ones, and a collection loaded from them continues the same run. The bf16 reduce-scatter (opt-in)
stays close. `tests/gpu/test_sharded_nccl.py` runs NCCL, and the step captured in a CUDA graph."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_sharding_fused import KEYS, MIXED, Probe, _diff, _run, tables

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.plan import plan_sharding

# name -> (optimizer, lookup dtype, replica_comm, plan, micro-batches per step)
CASES = {"sgd": ("sgd", torch.float32, "fp32", "data", 1),
         "adagrad": ("rowwise_adagrad", torch.float32, "fp32", "data", 1),
         "adam": ("adam", torch.float32, "fp32", "data", 1),
         "adam-bf16-lookups": ("adam", torch.bfloat16, "fp32", "data", 1),
         "adam-mixed-chunked": ("adam", torch.float32, "fp32", MIXED, 2),
         "adam-bf16-comm": ("adam", torch.float32, "bf16", "data", 1)}


def build(tabs, world, device, optimizer, dtype, update, comm="fp32", seed=3, lr=0.1, plan="data", check=True):
    """Tables placed by `plan` ("data": every table replicated; rows padded to a multiple of the ranks),
    `update` "sharded" or "all"."""
    overrides = plan if isinstance(plan, dict) else None
    placed = plan_sharding(tabs, world, "auto" if overrides else plan, overrides=overrides)
    return FusedShardedEmbeddingCollection.from_collection(
        EmbeddingCollection(tabs, seed=seed), placed, device=device, optimizer=optimizer, lr=lr, output_dtype=dtype,
        replica_update=update, replica_comm=comm, check=check)


def compare(rank, world, device, optimizer, dtype, comm, plan="data", chunks=1, dim=8, scale=3, lr=0.1) -> dict:
    """Max differences of the sharded update against the all-reduce one: outputs of 4 steps, whole
    tables and state after them, then 2 more steps of a fresh collection loaded from those. Tables
    of 243 rows by default (padded to 244 on 2 ranks)."""
    gen = torch.Generator().manual_seed(7)
    tabs = tables(dim, scale)
    batches = [torch.stack([torch.randint(0, t.num_embeddings, (16 * scale,), generator=gen) for t in tabs], 1)
               .to(device) for _ in range(6)]
    keys = KEYS[optimizer]
    opts = dict(tabs=tabs, world=world, device=device, optimizer=optimizer, dtype=dtype, lr=lr, plan=plan)
    ref = build(update="all", **opts)
    got = build(update="sharded", comm=comm, **opts)
    assert got.shards is not None and ref.shards is None
    ref_probe, probe = Probe(ref, len(tabs), dim).to(device), Probe(got, len(tabs), dim).to(device)
    ref_out, _ = _run(ref_probe, batches[:4], rank, world, chunks)
    out, _ = _run(probe, batches[:4], rank, world, chunks)
    weights, states = got.full_weights(), got.table_states(keys)
    ref_states = ref.table_states(keys)
    diffs = {"out": max(float((a - b).abs().max()) for a, b in zip(out, ref_out)),
             "weights": _diff(weights, ref.full_weights()),
             "state": max([_diff(states[t], ref_states[t]) for t in ref_states] + [0.0])}
    loaded = build(update="sharded", comm=comm, seed=11, **opts)  # other weights, then the trained ones
    loaded.load_full_weights(weights)
    loaded.load_table_states(keys, states, steps=4)
    ref_out, _ = _run(ref_probe, batches[4:], rank, world, chunks)
    out, _ = _run(Probe(loaded, len(tabs), dim).to(device), batches[4:], rank, world, chunks)
    diffs["resumed_out"] = max(float((a - b).abs().max()) for a, b in zip(out, ref_out))
    diffs["resumed_weights"] = _diff(loaded.full_weights(), ref.full_weights())
    return diffs


def worker(rank, world, store_path, results, device_type="cpu", dim=8, scale=3, lr=0.1):
    """One rank: every case compared; results on rank 0 (`device_type` cuda: NCCL and the kernels)."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world)
    try:
        for name, case in CASES.items():
            result = compare(rank, world, device, *case, dim=dim, scale=scale, lr=lr)
            if rank == 0:
                results[name] = result
    finally:
        dist.destroy_process_group()


def check(results: dict, tolerance: float, bf16_tolerance: float) -> None:
    """Every case within `tolerance` (the bf16 reduce-scatter within `bf16_tolerance`, and inexact)."""
    assert len(results) == len(CASES)
    for name, r in results.items():
        bound = bf16_tolerance if name.endswith("bf16-comm") else tolerance  # bf16 sums: inexact by design (opt-in)
        assert max(r.values()) < bound, (name, r)
    assert max(results["adam-bf16-comm"].values()) > 0  # the bf16 reduction did take place


def test_sharded_replica_update_trains_like_the_all_reduce_update(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    check(dict(results), 1e-6, 2e-2)


def compare_graphed(rank, world, device, steps=8, dim=32, scale=1000, lr=0.01) -> dict:
    """CUDA only: the sharded update (Adam) with every step after 3 eager ones replayed from a CUDA
    graph (the update deferred to `flush()` inside the step, as `ctrflow train` graphs it) against
    eager all-reduce steps: max differences of the outputs and, read after the replays, the tables."""
    gen = torch.Generator().manual_seed(7)
    tabs = tables(dim, scale)
    b = 16 * scale // world
    batches = [torch.stack([torch.randint(0, t.num_embeddings, (16 * scale,), generator=gen) for t in tabs], 1)
               .to(device) for _ in range(steps)]
    static = {"t_a": "table", "t_b": "table", "t_c": "data", "t_d": "data"}  # no row-wise table: no host read
    opts = dict(tabs=tabs, world=world, device=device, optimizer="adam", dtype=torch.float32, lr=lr, plan=static)
    ref = build(update="all", **opts)
    ref_out, _ = _run(Probe(ref, len(tabs), dim).to(device), batches, rank, world)
    got = build(update="sharded", check=False, **opts)  # no host read of the ids: capturable
    got.update_in_backward = False
    probe = Probe(got, len(tabs), dim).to(device)
    ids = batches[0][rank * b:(rank + 1) * b].clone()  # the graph's input

    def step() -> torch.Tensor:
        loss, out = probe(ids)
        loss.backward()
        got.flush()
        return out.detach()

    side, graph, out, outs = torch.cuda.Stream(device), torch.cuda.CUDAGraph(), None, []
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i, batch in enumerate(batches):
            ids.copy_(batch[rank * b:(rank + 1) * b])
            if i == 3:
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    out = step()
            if i < 3:
                outs.append(step().float().cpu())
            else:
                graph.replay()
                outs.append(out.float().cpu())
    torch.cuda.synchronize(device)
    weights = got.full_weights()
    graph.reset()  # before the process group goes
    return {"out": max(float((a - r).abs().max()) for a, r in zip(outs, ref_out)),
            "weights": _diff(weights, ref.full_weights())}


def graphed_worker(rank, world, store_path, results):
    """One rank of `compare_graphed` on NCCL; results on rank 0."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        result = compare_graphed(rank, world, device)
        if rank == 0:
            results.update(result)
    finally:
        dist.destroy_process_group()
