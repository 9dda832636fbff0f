"""NCCL on 2+ GPUs: the sharded collection equals the plain one (the CPU test's worker), and
`torchrun ... -m ctrflow train --device cuda` on 2 (and 4) GPUs logs the losses of 1 GPU for every
sharding (plain tables, fp32). The fused sharded collection (Triton kernels behind the all-to-all)
equals the fused one-process collection on the global batch (also as prefetched micro-batches with
one update per step), DLRM's micro-batched, in-place-layout (the interaction's MAPPED kernels) and
routed-ahead steps equal its plain step, and `ctrflow train` under torchrun takes the fused path by default,
logs the losses of one fused GPU, and its checkpoint resumes on one CPU. With the automatic plan it runs
the whole step as one CUDA graph (dense gradients averaged by the step, no DDP): it logs the losses and
AUCs of the eager DDP step, validates and checkpoints between replays, resumes, and exits (no NCCL
teardown hang). Multi-hot bags: the parity workers' bag cases (every sharding type, plain and fused,
each fused optimizer, Triton kernels), and a static bag plan's step (next step's ids routed ahead)
captured as one CUDA graph and replayed equals the eager step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.plan import plan_sharding
import tests.fixtures.sharding_fused as fused_parity
from tests.fixtures.bags import bag_batches, bag_tables
from tests.fixtures.sharding_parity import check_results, worker
from tests.fixtures.training import write_processed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
WORLDS = [2] + ([4] if torch.cuda.device_count() >= 4 else [])
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("world", WORLDS)
def test_n_gpus_match_plain_collection_for_every_sharding(tmp_path, world):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(world, str(tmp_path / "store"), results, "cuda"), nprocs=world, join=True)
    check_results(dict(results), 1e-5)  # CUDA's atomic index_add sums in any order


def _train(data: Path, out: Path, procs: int, *extra: str, embedding: str = "plain", device: str = "cuda",
           stdout: list | None = None, timeout: int = 600) -> list[float]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": "none", "PYTHONPATH": str(SRC)}
    # --standalone: the rendezvous binds a port the OS picks (a port probed free first was once taken)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           "-m", "ctrflow", "train", "--data", str(data), "--out", str(out), "--batch-size", "256",
           "--max-steps", "20", "--log-every", "1", "--device", device, "--no-progress",
           "--limit-eval-batches", "1", "--embedding", embedding, "--precision", "fp32", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    if stdout is not None:
        stdout.append(done.stdout)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """(data dir, per-step losses of one process): the reference every sharding is held to."""
    root = tmp_path_factory.mktemp("nccl")
    # 257 valid rows: the processes' shares differ by one, so validation pads a batch (fused all-to-alls)
    data = write_processed(root / "data", train_rows=256 * 20, valid_rows=257, cardinality=5000)
    return data, _train(data, root / "one", 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sharding", ["table", "row", "column", "data"])
def test_n_gpus_log_the_losses_of_one(tmp_path, one_gpu, sharding, world):
    data, one = one_gpu
    many = _train(data, tmp_path / "many", world, "--sharding", sharding)
    assert len(many) == len(one) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(many, one)) <= 1e-4


@pytest.mark.parametrize("world", WORLDS)
def test_fused_sharded_gpus_match_one_fused_process(tmp_path, world):
    results = mp.Manager().dict()
    # dim 32 (tensor-core pre-reduction), tables of up to 50k rows, batch 16,000, 10 steps, lr 0.01:
    # at lr 0.1 the probe's Adagrad/Adam trajectory is chaotic: the replicated tables' sums (another
    # summation order than one process's) drift 4e-4 after 4 steps and 2.5e-2 after 10 on 2 H200s,
    # while each update alone agrees to 1e-6 (measured on H200s)
    mp.spawn(fused_parity.worker, args=(world, str(tmp_path / "store"), results, "cuda", 32, 1000, 10, 0.01),
             nprocs=world, join=True)
    print({k: {m: v[m] for m in ("out", "loss", "weights", "state")} for k, v in dict(results).items()})
    # fp32 gradients are pre-reduced as two bf16 halves (~16 bits) in blocks that differ between the
    # two sides, and float atomics add in any order
    fused_parity.check(dict(results), 1e-4)


def test_torchrun_train_takes_the_fused_path_and_resumes_on_the_cpu(tmp_path, one_gpu):
    data, _ = one_gpu
    optim = ("--sparse-optimizer", "lazy_adam")
    one = _train(data, tmp_path / "one", 1, *optim, embedding="auto")
    plan = tmp_path / "plan.json"  # one table row-wise, one whole on rank 1, the small rest replicated
    plan.write_text(json.dumps({"tables": {"t_C1": "row", "t_C2": {"sharding": "table", "rank": 1}}}))
    two = _train(data, tmp_path / "two", 2, *optim, "--checkpoint-every", "10", "--plan", str(plan),
                 embedding="auto")
    ran = _run_plan(tmp_path / "two")
    assert (ran["device"], ran["processes"], ran["embedding"], ran["exchange_in_place"]) == ("cuda:0", 2, "fused", "off")
    assert max(abs(a - b) / abs(b) for a, b in zip(two, one)) <= 1e-3, (one, two)
    # the automatic plan has no row-wise table: DLRM's interaction reads the exchange buffers in place
    in_place = _train(data, tmp_path / "in_place", 2, *optim, embedding="auto")
    assert (_run_plan(tmp_path / "in_place")["embedding"], _run_plan(tmp_path / "in_place")["exchange_in_place"]) \
        == ("fused", "on")
    assert max(abs(a - b) / abs(b) for a, b in zip(in_place, one)) <= 1e-3, (one, in_place)
    (tmp_path / "two" / "latest").write_text("step_00000010\n")  # resume the 2-GPU run's step 10 ...
    resumed = _train(data, tmp_path / "cpu", 1, *optim, "--resume", str(tmp_path / "two"), embedding="plain",
                     device="cpu")  # ... on one CPU process, plain tables
    assert len(resumed) == 20 and max(abs(a - b) / abs(b) for a, b in zip(resumed[10:], one[10:])) <= 1e-3


def _run_plan(out: Path) -> dict:
    """The run plan a run recorded (`CKPT/config.json`)."""
    return json.loads((out / "config.json").read_text())["plan"]


def _metrics(out: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(loss by step, valid auc by step) from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in rows if "loss" in r}, {r["step"]: r["auc"] for r in rows if "auc" in r})


def test_torchrun_train_graphs_the_step_like_the_eager_one_and_exits(tmp_path, one_gpu, monkeypatch):
    data, _ = one_gpu
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)  # as a user runs it (gpu_h200x4.sh sets it)
    flags = ("--sparse-optimizer", "lazy_adam", "--eval-every", "5", "--checkpoint-every", "10")
    # a hang in NCCL's teardown (a graph still holding its calls) would hit the 240 s limit
    _train(data, tmp_path / "eager", 2, *flags, "--cuda-graphs", "off", embedding="auto", timeout=240)
    eager = _run_plan(tmp_path / "eager")
    assert (eager["cuda_graphs"], eager["dense_sync"], eager["compile"]) == ("off", "ddp", "off")
    _train(data, tmp_path / "graph", 2, *flags, embedding="auto", timeout=240)
    graph = _run_plan(tmp_path / "graph")
    assert (graph["embedding"], graph["exchange_in_place"], graph["cuda_graphs"], graph["dense_sync"],
            graph["compile"]) == ("fused", "on", "on", "average", "parts")
    (eager_loss, eager_auc), (graph_loss, graph_auc) = _metrics(tmp_path / "eager"), _metrics(tmp_path / "graph")
    assert len(graph_loss) == 20 and sorted(graph_auc) == sorted(eager_auc) == [5, 10, 15, 20]
    loss_gap = max(abs(graph_loss[k] - eager_loss[k]) / abs(eager_loss[k]) for k in eager_loss)
    auc_gap = max(abs(graph_auc[k] - eager_auc[k]) for k in eager_auc)
    print(f"graph vs eager on 2 GPUs: max relative loss gap {loss_gap:.2e}, max auc gap {auc_gap:.2e}")
    # same arithmetic up to float atomics' order (fused tables), capturable Adam and where DDP divides
    assert loss_gap <= 1e-3 and auc_gap <= 2e-3, (eager_loss, graph_loss, eager_auc, graph_auc)
    (tmp_path / "graph" / "latest").write_text("step_00000010\n")  # resume the graphed run's step 10, graphed
    _train(data, tmp_path / "resumed", 2, *flags, "--resume", str(tmp_path / "graph"), embedding="auto",
           timeout=240)
    resumed_loss, resumed_auc = _metrics(tmp_path / "resumed")
    resume_gap = max(abs(resumed_loss[k] - graph_loss[k]) / abs(graph_loss[k]) for k in range(11, 21))
    print(f"resumed at step 10 vs the graphed run: max relative loss gap {resume_gap:.2e}")
    assert resume_gap <= 1e-3 and abs(resumed_auc[20] - graph_auc[20]) <= 2e-3


def _bag_model(tables, plan, device) -> torch.nn.Module:
    """A fixed readout of fused sharded multi-hot tables (Adam), updated at the caller's `flush()`."""
    coll = FusedShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=3), plan, device=device,
                                                           optimizer="adam", lr=0.01, check=False)
    coll.update_in_backward = False  # as the graphed training step: the caller flushes
    return fused_parity.Probe(coll, len(tables), tables[0].embedding_dim).to(device)


def _bag_step(model, ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """One step: lookups started with the next step's ids routed ahead, backward, the tables' update."""
    model.embeddings.prefetch([ids], next_ids=next_ids)
    loss, _ = model(ids)
    loss.backward()
    model.embeddings.flush()
    return loss.detach()


def _graph_worker(rank, world, store, results):
    """8 steps of a static multi-hot plan (bags whole on one rank or replicated), eager and as a
    CUDA graph captured at step 4 and replayed; (max relative loss gap, max table difference)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tables = bag_tables(32, 100)
        plan = plan_sharding(tables, world, overrides=fused_parity.STATIC)
        assert all(tp.sharding in ("table", "data") for tp in plan.tables.values())
        b = 512
        ids = [x[rank * b:(rank + 1) * b].to(device) for x in bag_batches(tables, b * world, 9, seed=3)]
        eager = _bag_model(tables, plan, device)
        eager_losses = [_bag_step(eager, ids[i], ids[i + 1]) for i in range(8)]
        graphed, losses = _bag_model(tables, plan, device), []
        static_ids, static_next = ids[3].clone(), ids[4].clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up and capture off the default stream, as torch asks
            losses += [_bag_step(graphed, ids[i], ids[i + 1]) for i in range(3)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                static_loss = _bag_step(graphed, static_ids, static_next)
        torch.cuda.current_stream(device).wait_stream(side)
        for i in range(3, 8):
            static_ids.copy_(ids[i])
            static_next.copy_(ids[i + 1])
            graph.replay()
            losses.append(static_loss.clone())
        torch.cuda.synchronize()
        gap = max(abs(float(a) - float(e)) / abs(float(e)) for a, e in zip(losses, eager_losses))
        weights = fused_parity._diff(graphed.embeddings.full_weights(), eager.embeddings.full_weights())
        graph.reset()  # before the process group goes: NCCL waits for graphs holding its calls
        if rank == 0:
            results["graph"] = (gap, weights)
    finally:
        dist.destroy_process_group()


def test_a_multi_hot_static_plan_steps_as_one_cuda_graph_like_the_eager_step(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_graph_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    gap, weights = results["graph"]
    print(f"multi-hot graph vs eager on 2 GPUs: max relative loss gap {gap:.2e}, max table difference {weights:.2e}")
    assert gap <= 1e-4 and weights <= 1e-4, (gap, weights)  # float atomics add in any order
