"""`ctrflow train` on one GPU with multi-hot features: the fused path (bag kernel, CUDA-graphed step)
learns like the plain fp32 path for every model, with and without dense features, and its
checkpoint scores the same on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from ctrflow.checkpoint import load_model
from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.loaders.memory import BatchLoader, ParquetDataset
from ctrflow.train.loop import train
from tests.fixtures.multihot import mixed_features, write_mixed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def config(data, out, model, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=1024, eval_batch_size=4096),
                       model=ModelConfig(name=model, embedding_dim=32), optim=OptimConfig(sparse="lazy_adam"),
                       device="cuda", epochs=2, progress=False, log_every=10, **kw)


@pytest.mark.parametrize("dense", [3, 0], ids=["dense", "no_dense"])
@pytest.mark.parametrize("model", ["dlrm", "dcnv2", "deepfm", "wide_deep"])
def test_gpu_multi_hot_training_is_fused_and_learns_like_the_plain_path(tmp_path, model, dense):
    data = write_mixed(tmp_path / "data", mixed_features(dense, 2, 3, cardinality=500, max_length=20),
                       train_rows=1024 * 30, valid_rows=8192)
    fast = train(config(data, tmp_path / "fast", model))
    assert json.loads((tmp_path / "fast" / "config.json").read_text())["plan"]["embedding"] == "fused"
    plain = train(config(data, tmp_path / "plain", model, embedding="plain", precision="fp32"))
    assert fast["valid_auc"] > 0.65
    assert abs(fast["valid_auc"] - plain["valid_auc"]) < 0.01, (fast, plain)
    cpu_model, _schema, _meta = load_model(tmp_path / "fast")
    batch = next(BatchLoader(ParquetDataset(data, "valid"), 4096, shuffle=False, drop_last=False,
                             prefetch=0).batches(0))
    cpu_logits = cpu_model(batch.dense, batch.sparse)
    gpu_model, _, _ = load_model(tmp_path / "fast")
    gpu_model.embeddings = FusedEmbeddingCollection.from_collection(gpu_model.embeddings, device="cuda")
    gpu_model.cuda()
    with torch.no_grad():
        gpu_logits = gpu_model(batch.dense.cuda(), batch.sparse.cuda()).cpu()
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-3, atol=1e-3)
