"""`ctrflow train` on one GPU: the CUDA-graphed step trains exactly like the eager one, the compiled
head and `--precision fp8` learn like the plain bf16 path, and their checkpoints load as usual; DeepFM
and Wide&Deep (their dense parts compiled apart) learn like their plain fp32 path too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures.training import write_processed

from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from ctrflow.models.dcnv2 import DCNv2Config  # noqa: E402
from ctrflow.checkpoint import load_model  # noqa: E402
from ctrflow.train.loop import train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def config(data, out, **kw) -> TrainConfig:
    # DCNv2 at widths fp8 takes: 27 x 32 = 864 into cross layers of rank 512 and a 512-wide deep MLP
    model = ModelConfig(name="dcnv2", embedding_dim=32,
                        arch=DCNv2Config(bottom_mlp=(64,), deep_mlp=(512, 256), cross_layers=2, cross_rank=512))
    return TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=1024, eval_batch_size=4096),
                       model=model, optim=OptimConfig(sparse="adagrad", warmup_steps=5), device="cuda",
                       epochs=1, progress=False, log_every=1, **kw)


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("data"), train_rows=1024 * 20, valid_rows=8192, cardinality=60)


def test_graphed_steps_equal_eager_steps(data, tmp_path):
    eager = train(config(data, tmp_path / "eager", cuda_graphs="off", compile="off"))
    graphed = train(config(data, tmp_path / "graphed", compile="off"))
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "graphed")
    assert len(a) == len(b) == 20
    # same kernels on the same numbers, up to the fused tables' atomic adds (their order varies) and
    # capturable Adam's device-side arithmetic: at most 1.6e-5 over 20 steps, measured on an H200
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert abs(eager["valid_auc"] - graphed["valid_auc"]) < 1e-4


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 tensor cores need compute capability 8.9+")
def test_compiled_and_fp8_runs_learn_like_bf16(data, tmp_path):
    plain = train(config(data, tmp_path / "plain", embedding="plain", precision="fp32"))
    fast = train(config(data, tmp_path / "fast"))  # defaults: fused tables, compiled head, graph
    fp8 = train(config(data, tmp_path / "fp8", precision="fp8"))
    ran = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert (ran["plan"]["compile"], ran["plan"]["cuda_graphs"], ran["resolved"]["precision"]) == ("head", "on", "fp8")
    assert ran["plan"]["precision.wide_linear"].startswith("fp8")
    assert fast["valid_auc"] > 0.6
    assert abs(fast["valid_auc"] - plain["valid_auc"]) < 0.01, (fast, plain)
    assert abs(fp8["valid_auc"] - plain["valid_auc"]) < 0.01, (fp8, plain)
    model, _, _ = load_model(tmp_path / "fp8")  # a plain fp32 model on the CPU, as evaluate reads it
    assert type(model.interaction.down[0]) is torch.nn.Linear


@pytest.mark.parametrize("name", ["deepfm", "wide_deep"])
def test_other_models_learn_on_the_fast_path_like_the_plain_one(data, tmp_path, name):
    def run(out, **kw):
        return train(TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=1024, eval_batch_size=4096),
                                 model=ModelConfig(name=name, embedding_dim=32), device="cuda", epochs=1,
                                 progress=False, **kw))

    plain = run(tmp_path / "plain", embedding="plain", precision="fp32")
    fast = run(tmp_path / "fast")  # defaults: fused tables, aligned and compiled dense parts, fused Adam, graph
    assert fast["valid_auc"] > 0.6 and abs(fast["valid_auc"] - plain["valid_auc"]) < 0.02, (fast, plain)
    model, _, _ = load_model(tmp_path / "fast")
    assert not any(p.isnan().any() for p in model.parameters())
