"""`ctrflow train` on one GPU takes the fused path (Triton tables, bf16 dense) by default; it
learns like the plain path, and its checkpoint loads on the CPU with the same predictions."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.training import write_processed

from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from ctrflow.loaders.memory import BatchLoader, ParquetDataset  # noqa: E402
from ctrflow.embedding.fused import FusedEmbeddingCollection  # noqa: E402
from ctrflow.checkpoint import load_model  # noqa: E402
from ctrflow.train.loop import train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def config(data, out, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=1024, eval_batch_size=4096),
                       model=ModelConfig(name="dlrm", embedding_dim=32), optim=OptimConfig(sparse="lazy_adam"),
                       device="cuda", epochs=2, progress=False, log_every=10, **kw)


def test_gpu_train_defaults_to_fused_and_matches_the_plain_path(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=1024 * 30, valid_rows=8192, cardinality=60)
    fast = train(config(data, tmp_path / "fast"))
    ran = json.loads((tmp_path / "fast" / "config.json").read_text())["plan"]
    assert (ran["embedding"], ran["precision.dense"], ran["precision.lookups"], ran["cuda_graphs"], ran["compile"],
            ran["align_linear"]) == ("fused", "bf16 autocast", "bf16", "on", "parts", "on")
    plain = train(config(data, tmp_path / "plain", embedding="plain", precision="fp32"))
    assert fast["valid_auc"] > 0.6
    assert abs(fast["valid_auc"] - plain["valid_auc"]) < 0.01, (fast, plain)
    model, _schema, _meta = load_model(tmp_path / "fast")  # CPU, plain, fp32: what evaluate/export read
    batch = next(BatchLoader(ParquetDataset(data, "valid"), 4096, shuffle=False, drop_last=False,
                             prefetch=0).batches(0))
    cpu_logits = model(batch.dense, batch.sparse)
    gpu_model, _, _ = load_model(tmp_path / "fast")
    coll = FusedEmbeddingCollection.from_collection(gpu_model.embeddings, device="cuda")
    gpu_model.embeddings = coll
    gpu_model.cuda()
    with torch.no_grad():
        gpu_logits = gpu_model(batch.dense.cuda(), batch.sparse.cuda()).cpu()
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-3, atol=1e-3)
