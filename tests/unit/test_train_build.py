"""The run plan and `accelerate` (`ctrflow.accel.plan`, `.accelerate`): every `auto` resolved into a
run plan (also for GPUs and N processes, decided here without either), the rewrites applied in one
order over the same parameters, and the resolved plan recorded where a user finds it: the checkpoint's
config.json and meta.json and the tracker's params, never the literal "auto"."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ctrflow.cli import main
from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.embedding.collection import deferred_tables
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.accel.dense import AlignedLinear
from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.checkpoint import load_model, resolve_checkpoint
from ctrflow.contract.features import Features
from ctrflow.models import build_model
from ctrflow.tracking import Tracker
from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.plan import Fp8Plan, RunPlan, plan_run
from ctrflow.runtime import Runtime
from ctrflow.accel.fp8.cross import AbsorbedFp8Linear, Fp8CrossNet
from ctrflow.train.loop import train
from tests.fixtures.training import write_processed

FEATURES = Features.categorical([30] * 26, 13)
CPU, CUDA = Runtime(0, 1, 0, torch.device("cpu")), Runtime(0, 1, 0, torch.device("cuda", 0))

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=2048, valid_rows=512, cardinality=30)


def values(tree) -> list:
    """Every leaf value of a nested dict."""
    if isinstance(tree, dict):
        return [v for value in tree.values() for v in values(value)]
    return [tree]


def model_of(name: str, dim: int = 16, **arch):
    with deferred_tables():
        return build_model(name, FEATURES, dim, **arch)


def plan_of(name: str, runtime: Runtime, **kw) -> RunPlan:
    config = TrainConfig(out="o", model=ModelConfig(name=name), **kw)
    return plan_run(config, runtime, model_of(name))


def test_a_config_file_run_trains_and_its_checkpoint_records_the_resolved_plan(data_dir, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  name: dcnv2\n  bottom_mlp: [24]\n  deep_mlp: [48, 24]\n  cross_layers: 2\n"
                   "  cross_rank: 8\n  dropout: 0.2\ndata:\n  batch_size: 256\n")
    out = tmp_path / "ckpt"
    assert main(["train", "--config", str(run), "--data", str(data_dir), "--out", str(out), "--max-steps", "6",
                 "--no-progress", "--tracking-uri", "none"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("run plan") == 1 and "loader                   memory on cpu" in printed
    model, _schema, meta = load_model(out)
    assert meta["model"]["arch"] == {"bottom_mlp": [24], "deep_mlp": [48, 24], "cross_layers": 2, "cross_rank": 8,
                                     "dropout": 0.2}
    assert model.over_arch[0].out_features == 48 and model.interaction.down[0].out_features == 8
    record = json.loads((out / "config.json").read_text())
    asked, resolved, plan = record["asked"], record["resolved"], record["plan"]
    assert (asked["device"], asked["embedding"], asked["data"]["loader"]) == ("auto", "auto", "auto")
    assert (resolved["device"], resolved["embedding"], resolved["precision"], resolved["cuda_graphs"],
            resolved["compile"], resolved["sharding"], resolved["data"]["loader"]) == \
        ("cpu", "plain", "fp32", "off", "off", "none", "memory")
    assert resolved["optim"]["sparse"] == "adam"  # 30-row tables: auto is dense Adam below 1,000 rows
    assert (plan["device"], plan["processes"], plan["precision.dense"], plan["sharding_plan"]) == ("cpu", 1, "fp32", None)
    assert "auto" not in values(resolved) + values(plan)
    step_meta = json.loads((resolve_checkpoint(out) / "meta.json").read_text())
    assert step_meta["resolved"] == resolved and step_meta["plan"] == plan and step_meta["config"] == asked
    # the checkpoint's config.json is a config file too: the run as asked for
    assert main(["train", "--config", str(out / "config.json"), "--print-config"]) == 0
    assert "cross_rank: 8" in capsys.readouterr().out


class Recording(Tracker):
    """A tracker that keeps what it was given."""

    def __init__(self):
        self.params: dict = {}

    def log_params(self, params) -> None:
        self.params.update(params)


def test_the_tracker_gets_the_resolved_choices_as_params(data_dir, tmp_path):
    tracker = Recording()
    config = TrainConfig(out=str(tmp_path / "ckpt"), data=DataConfig(path=str(data_dir), batch_size=256),
                         model=ModelConfig(name="deepfm"), embedding="fused", max_steps=3, progress=False)
    train(config, tracker)
    params = tracker.params
    assert (params["device"], params["embedding"], params["data.loader"], params["model.name"]) == \
        ("cpu", "fused", "memory", "deepfm")
    # the vectors are fused, the first-order dim-1 tables stay plain (dense Adam at 30 rows)
    assert (params["plan.embedding"], params["plan.sparse_optimizer"]) == ("fused", "lazy_adam 26, adam 26")
    assert (params["plan.cuda_graphs"], params["plan.compile"], params["plan.loader"]) == ("off", "off", "memory on cpu")
    assert "auto" not in params.values()


def test_a_gpu_run_is_planned_fused_graphed_compiled_bf16_and_aligned():
    dlrm = plan_of("dlrm", CUDA, embedding="fused")
    assert (dlrm.embedding, dlrm.cuda_graphs, dlrm.compile, dlrm.autocast, dlrm.align_linear, dlrm.dense_sync) == \
        ("fused", True, "parts", "bf16", True, "none")
    assert set(dlrm.sparse_kinds.values()) == {"lazy_adam"} and dlrm.record()["precision.lookups"] == "bf16"
    assert plan_of("dcnv2", CUDA, embedding="fused").compile == "head"  # one inductor graph after the lookup
    deepfm = plan_of("deepfm", CUDA, embedding="fused")  # dim-1 first-order tables stay plain: no graph
    assert (deepfm.cuda_graphs, deepfm.compile) == (False, "parts")
    assert not plan_of("dlrm", CUDA, embedding="fused", optim=OptimConfig(dense="sgd")).cuda_graphs
    off = plan_of("dlrm", CUDA, embedding="fused", cuda_graphs="off", compile="off", precision="fp32")
    assert (off.cuda_graphs, off.compile, off.autocast, off.fp8) == (False, "off", "fp32", None)
    plain = plan_of("dlrm", CUDA, embedding="plain")
    assert (plain.embedding, plain.cuda_graphs, plain.compile, plain.record()["precision.lookups"]) == \
        ("plain", False, "off", "fp32")


def test_n_processes_are_planned_with_a_sharding_plan_and_their_dense_sync():
    two = Runtime(0, 2, 0, torch.device("cpu"))
    fused = plan_of("dlrm", two, embedding="fused")
    assert fused.sharding is not None and fused.sharding.world_size == 2 and fused.dense_sync == "ddp"
    assert fused.exchange_in_place and fused.record()["sharding"] == "data"  # small tables: replicated
    rows = plan_of("dlrm", two, embedding="fused", sharding="row")
    assert not rows.exchange_in_place and rows.record()["sharding"] == "row"  # sizes depend on the ids
    plain = plan_of("dlrm", two, embedding="plain", sharding="table")
    assert (plain.embedding, plain.exchange_in_place, plain.dense_sync) == ("plain", False, "ddp")
    assert {tp.sharding for tp in plain.sharding.tables.values()} == {"table"}


def test_build_applies_every_rewrite_over_the_same_parameters():
    model = build_model("dcnv2", FEATURES, 32, bottom_mlp=(16,), deep_mlp=(512, 64), cross_layers=2, cross_rank=512)
    dense_before = {name: p for name, p in model.named_parameters() if not name.startswith("embeddings.")}
    plan = RunPlan(embedding="fused", fp8=Fp8Plan(), align_linear=True, compile="head",
                   optim=OptimConfig(sparse="adagrad"))
    built = accelerate(model, plan, CPU)
    assert built.model is model and list(built.fused) == ["embeddings"]
    assert isinstance(model.embeddings, FusedEmbeddingCollection)
    assert type(model.interaction) is Fp8CrossNet and type(model.over_arch[0]) is AbsorbedFp8Linear
    assert type(model.dense_arch[0]) is AlignedLinear  # 13 dense inputs padded to 16
    assert "head" in vars(model)  # compiled (lazily: nothing is built until the first call)
    assert built.changes == {"fp8_layers": 5, "aligned_layers": 1, "exchange_in_place": False, "compiled": True}
    dense_after = dict(model.named_parameters())
    assert dense_after.keys() == dense_before.keys()
    assert all(dense_after[name] is p for name, p in dense_before.items())  # optimizers see the same tensors


def test_build_leaves_tables_a_caller_made_and_swaps_dlrm_s_interaction():
    model = build_model("dlrm", FEATURES, 16, bottom_mlp=(8,), top_mlp=(8,))
    own = FusedEmbeddingCollection(model.embeddings.tables, seed=3)  # e.g. a benchmark's, drawn on its device
    model.embeddings = own
    built = accelerate(model, dataclasses.replace(RunPlan(), embedding="fused"), CPU)
    assert model.embeddings is own and built.fused == {"embeddings": own}
    assert type(model.interaction) is FusedDotInteraction
