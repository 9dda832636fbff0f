"""FusedEmbeddingCollection off the GPU (its torch path): same tables, same updates as the plain path."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.tables import tables_for
from ctrflow.errors import UserError
from ctrflow.contract.features import Features

SIZES = [50, 3, 700, 10]
TABLES = tables_for(Features.categorical(dict(zip(["C1", "C2", "C3", "C4"], SIZES))).sparse, 8)


def batches(steps: int, batch: int = 64):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in SIZES], dim=1)
        yield ids, torch.randn(batch, len(SIZES), 8, generator=gen)


def test_starts_from_the_plain_collections_weights():
    plain, fused = EmbeddingCollection(TABLES, seed=4), FusedEmbeddingCollection(TABLES, seed=4)
    ids = next(batches(1))[0]
    assert torch.equal(fused(ids), plain(ids))
    for name, weight in plain.full_weights().items():
        assert torch.equal(fused.full_weights()[name], weight)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_updates_match_plain_sparse_optimizers(optimizer):
    plain = EmbeddingCollection(TABLES, seed=1)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=0.05)
    params = list(plain.weights.values())
    opt = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowwiseAdagrad, "adam": torch.optim.SparseAdam}[optimizer](
        params, lr=0.05)
    for ids, upstream in batches(4):
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream)
        opt.step()
        fused(ids).backward(upstream)
    # Adam divides by sqrt(v): an element whose summed grad nearly cancels amplifies rounding
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for name, weight in plain.full_weights().items():
        torch.testing.assert_close(fused.full_weights()[name], weight, rtol=1e-5, atol=atol)


def test_has_no_parameters_for_dense_optimizers():
    fused = FusedEmbeddingCollection(TABLES)
    assert list(fused.parameters()) == [] and fused.weights == {}


def test_out_of_range_id_names_the_feature():
    ids = torch.zeros(2, 4, dtype=torch.int64)
    ids[1, 2] = 700
    with pytest.raises(UserError, match="C3"):
        FusedEmbeddingCollection(TABLES)(ids)


# --- multi-hot bags: the fused collection's torch version against the plain collection --------------------------

from ctrflow.embedding.pooling import pool_bags, slot_scales  # noqa: E402
from ctrflow.contract.features import Feature  # noqa: E402

MIXED = Features(dense=(), sparse=(
    Feature("c", "categorical", cardinality=40),
    Feature("s", "multi_hot", cardinality=60, max_length=5, pooling="sum"),
    Feature("m", "multi_hot", cardinality=25, max_length=7, pooling="mean"),
    Feature("one", "multi_hot", cardinality=9, max_length=1, pooling="mean")))
MIXED_TABLES = tables_for(MIXED.sparse, 8)


def bag_batches(steps: int, batch: int = 64, seed: int = 0):
    """ids [B, S] with ragged bags (ids then padding, some bags empty, repeats within a bag) and an
    upstream gradient [B, T, D]."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        columns = []
        for f in MIXED.sparse:
            if f.kind == "categorical":
                columns.append(torch.randint(0, f.cardinality, (batch, 1), generator=gen))
                continue
            ids = torch.randint(1, f.cardinality, (batch, f.max_length), generator=gen)
            lengths = torch.randint(0, f.max_length + 1, (batch, 1), generator=gen)
            columns.append(torch.where(torch.arange(f.max_length) < lengths, ids, 0))
        yield torch.cat(columns, dim=1), torch.randn(batch, len(MIXED.sparse), 8, generator=gen)


def test_plain_bags_follow_the_pooling_rule():
    plain = EmbeddingCollection(MIXED_TABLES, seed=2)
    ids, _ = next(bag_batches(1))
    out = plain(ids)
    w = plain.full_weights()
    assert out.shape == (64, 4, 8)
    b = int(torch.nonzero((ids[:, 1:6] != 0).sum(1) >= 2)[0])  # a sum bag of two or more ids
    assert torch.allclose(out[b, 1], w["t_s"][ids[b, 1:6][ids[b, 1:6] != 0]].sum(0))
    m = ids[:, 6:13]
    b = int(torch.nonzero((m != 0).sum(1) >= 2)[0])
    assert torch.allclose(out[b, 2], w["t_m"][m[b][m[b] != 0]].mean(0))
    empty = int(torch.nonzero((m != 0).sum(1) == 0)[0])
    assert torch.equal(out[empty, 2], torch.zeros(8))  # an empty bag: zeros, not row 0
    assert torch.equal(out[:, 0], w["t_c"][ids[:, 0]])  # one id: its row as is (id 0 included)
    scales = slot_scales(ids, MIXED_TABLES)
    values = torch.cat([w["t_c"][ids[:, :1]], w["t_s"][ids[:, 1:6]], w["t_m"][ids[:, 6:13]],
                        w["t_one"][ids[:, 13:]]], 1)
    by_scale = torch.stack([(values[:, a:z] * scales[:, a:z, None]).sum(1) for a, z in ((0, 1), (1, 6), (6, 13),
                                                                                           (13, 14))], 1)
    torch.testing.assert_close(by_scale, pool_bags(values, ids, MIXED_TABLES))


def test_fused_bags_start_from_the_plain_lookup():
    plain, fused = EmbeddingCollection(MIXED_TABLES, seed=4), FusedEmbeddingCollection(MIXED_TABLES, seed=4)
    ids, _ = next(bag_batches(1))
    assert torch.equal(fused(ids), plain(ids))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_fused_bag_updates_match_plain_sparse_optimizers(optimizer):
    plain = EmbeddingCollection(MIXED_TABLES, seed=1)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=0.05)
    before = {k: v.clone() for k, v in plain.full_weights().items()}
    params = list(plain.weights.values())
    opt = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowwiseAdagrad, "adam": torch.optim.SparseAdam}[optimizer](
        params, lr=0.05)
    for ids, upstream in bag_batches(4):
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream)
        opt.step()
        fused(ids).backward(upstream)
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for name, weight in plain.full_weights().items():
        torch.testing.assert_close(fused.full_weights()[name], weight, rtol=1e-5, atol=atol)
        assert not torch.equal(weight, before[name])  # the bags trained every table
    # padding never moves a multi-hot table's row 0; a categorical table's row 0 ("missing") learns
    assert torch.equal(fused.full_weights()["t_s"][0], before["t_s"][0])
    assert torch.equal(fused.full_weights()["t_m"][0], before["t_m"][0])


def test_fused_bags_check_every_slot_and_name_the_feature():
    ids, _ = next(bag_batches(1, batch=4))
    ids[2, 9] = 25  # a slot of m (25 rows)
    with pytest.raises(UserError, match="feature m"):
        FusedEmbeddingCollection(MIXED_TABLES)(ids)
    with pytest.raises(ValueError, match=r"\[B, 14\]"):
        FusedEmbeddingCollection(MIXED_TABLES)(ids[:, :4])


def test_a_collection_of_no_tables_returns_no_vectors():
    empty = EmbeddingCollection([], embedding_dim=8)
    out = empty(torch.zeros(5, 0, dtype=torch.int64))
    assert out.shape == (5, 0, 8) and list(empty.parameters()) == []
