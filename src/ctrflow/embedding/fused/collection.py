"""`FusedEmbeddingCollection`: every table in one buffer, one-kernel lookup, optimizer step in backward.

One-id tables gather rows (`ops.lookup`); a collection with multi-hot tables gathers and pools its
bags in one kernel (`bags.lookup_bags`); both update in backward through the same sort / sum /
optimizer kernels (`ops.update_rows`), a padding slot getting no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection, copy_table_rows, init_table
from ctrflow.embedding.fused import bags, ops
from ctrflow.embedding.pooling import is_one_hot, slot_count, slot_tables
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError


class _FusedLookup(torch.autograd.Function):
    """ids -> embeddings; backward applies the collection's optimizer step and returns no gradient."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, collection: "FusedEmbeddingCollection"):
        ctx.collection = collection
        ctx.save_for_backward(ids)
        return ops.lookup(ids, collection.offsets, collection.weight, collection.output_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        coll = ctx.collection
        ops.update_rows(ids, coll.offsets, grad, coll.weight, coll.row_state, coll.scratch, coll.pre_reduce)
        return None, None, None


class _FusedBags(torch.autograd.Function):
    """ids [B, S] -> pooled [B, T, D]; backward applies the optimizer step to every slot's row."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, collection: "FusedEmbeddingCollection"):
        ctx.collection = collection
        out, scales = bags.lookup_bags(ids, collection.bag_layout(), collection.weight, collection.output_dtype,
                                       save_scales=ctx.needs_input_grad[1])
        ctx.save_for_backward(ids, scales)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ids, scales = ctx.saved_tensors
        coll = ctx.collection
        bags.update_bags(ids, coll.bag_layout(), grad, scales, coll.weight, coll.row_state, coll.scratch,
                         coll.pre_reduce)
        return None, None, None


class FusedEmbeddingCollection(nn.Module):
    """Drop-in for `EmbeddingCollection` (ids [B, S] -> [B, T, D], one-id tables and multi-hot bags,
    `tables`, `full_weights()`) that trains itself: the backward pass sums each distinct row's
    gradient (a bag's id: its bag's gradient, / count for mean, none for padding) and applies `optimizer`
    ("sgd", "rowwise_adagrad" or "adam", the lazy Adam of `torch.optim.SparseAdam`) in place.

    The weights are a buffer, not a parameter: dense optimizers and DDP never see them, and no
    gradient tensor is ever made. `storage_dtype` may be bf16/fp16 (updates computed in fp32);
    `output_dtype` is the lookup's dtype (bf16 halves the bytes of the output and its gradient).
    Built on CPU the weights equal `EmbeddingCollection(tables, seed)`'s; built with
    `device="cuda"` they are drawn there (same bounds, other numbers) to skip a host copy.
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
                 storage_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), check_ids: bool = True, pre_reduce: bool = True):
        super().__init__()
        if optimizer not in ops.OPTIMIZERS:
            raise ValueError(f"unknown fused optimizer {optimizer!r}; choose one of {', '.join(ops.OPTIMIZERS)}")
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:  # also refuses no tables: a collection without tables has nothing to fuse
            raise ValueError(f"a fused collection needs tables of one embedding_dim, got {sorted(dims)}")
        self.tables = list(tables)
        self.embedding_dim = dims.pop()
        self.output_dtype = output_dtype
        self.check_ids = check_ids
        self.pre_reduce = pre_reduce
        self.one_hot = is_one_hot(self.tables)
        self.slots = slot_count(self.tables)
        sizes = [t.num_embeddings for t in self.tables]
        starts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
        device = torch.device(device or "cpu")
        self.register_buffer("offsets", torch.tensor(starts, dtype=torch.int64, device=device))
        # [S] every slot's table size: the range check of ids [B, S]
        self.register_buffer("sizes", torch.tensor([sizes[i] for i in slot_tables(self.tables)], dtype=torch.int64,
                                                   device=device), persistent=False)
        for name, tensor in bags.layout_tensors(self.tables, starts).items():
            self.register_buffer(f"bag_{name}", tensor.to(device), persistent=False)
        self.register_buffer("weight", _init_weights(self.tables, seed, storage_dtype, device))
        rows, dim = self.weight.shape
        # unused state is one element, not empty: kernels get a valid pointer either way
        state1 = {"rowwise_adagrad": (rows,), "adam": (rows, dim)}.get(optimizer, (1,))
        state2 = (rows, dim) if optimizer == "adam" else (1,)
        self.row_state = ops.RowState(
            optimizer, torch.tensor([lr, 0.0], device=device), torch.zeros(state1, device=device),
            torch.zeros(state2, device=device), eps, betas[0], betas[1])
        self.scratch: dict = {}

    @classmethod
    def from_collection(cls, plain: EmbeddingCollection, **options) -> "FusedEmbeddingCollection":
        """A fused copy of a plain collection's tables and weights (options as for the constructor)."""
        fused = cls(plain.tables, **options)
        with torch.no_grad():  # table by table, in chunks: a deferred collection is never whole on the host
            for i, (t, start) in enumerate(zip(plain.tables, fused.offsets.tolist())):
                copy_table_rows(plain, i, 0, t.num_embeddings, fused.weight[start:start + t.num_embeddings])
        return fused

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        st = self.row_state
        st.hyper, st.state1, st.state2 = fn(st.hyper), fn(st.state1), fn(st.state2)
        self.scratch.clear()
        return self

    def set_lr(self, lr: float) -> None:
        """New learning rate for the next steps (written in place: captured graphs see it too)."""
        self.row_state.hyper[0].fill_(lr)

    def bag_layout(self) -> bags.BagLayout:
        """Where the slots and tables lie in the buffer (for `bags.lookup_bags`)."""
        return bags.BagLayout(tuple(self.tables), self.bag_slot_offsets, self.bag_slot_table, self.bag_table_start,
                              self.bag_table_length, self.bag_table_mode, self.bag_table_offset)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.slots:
            raise ValueError(f"ids must be [B, {self.slots}], got {list(ids.shape)}")
        if self.check_ids and not _capturing(ids):
            self._check_range(ids)
        anchor = ids.new_empty(0, dtype=torch.float32).requires_grad_(torch.is_grad_enabled())
        return (_FusedLookup if self.one_hot else _FusedBags).apply(ids, anchor, self)

    def _check_range(self, ids: torch.Tensor) -> None:
        # a device-to-host read: off (check_ids=False) in timed and captured loops
        bad = ((ids < 0) | (ids >= self.sizes)).any(dim=0)  # [S]
        if bool(bad.any()):
            table = self.tables[slot_tables(self.tables)[int(bad.nonzero()[0])]]
            raise UserError(f"feature {table.feature}: ids outside its table of {table.num_embeddings} rows")

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name (views of the one buffer, in the storage dtype)."""
        out = {}
        for t, start in zip(self.tables, self.offsets.tolist()):
            out[t.name] = self.weight[start:start + t.num_embeddings].detach()
        return out

    def full_table(self, name: str) -> torch.Tensor:
        """One whole table (a view of the buffer): the per-table face checkpoints write through."""
        start, rows = self._span(name)
        return self.weight[start:start + rows].detach()

    def _span(self, name: str) -> tuple[int, int]:
        """(first row in the one buffer, rows) of table `name`."""
        index = next(i for i, t in enumerate(self.tables) if t.name == name)
        return int(self.offsets[index]), self.tables[index].num_embeddings

    @torch.no_grad()
    def load_full_weights(self, tables: dict[str, torch.Tensor]) -> None:
        """Overwrite every table from whole tables by name (a checkpoint's; any dtype or device)."""
        for t, start in zip(self.tables, self.offsets.tolist()):
            self.weight[start:start + t.num_embeddings].copy_(tables[t.name])

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """No trainable parameters: the tables update themselves in backward (see `full_weights`)."""
        return {}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The row optimizer's state: `hyper` [lr, step] and its per-row tensors (for checkpoints)."""
        st = self.row_state
        return {"hyper": st.hyper, "state1": st.state1, "state2": st.state2}

    def table_states(self, keys: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state as whole tables: {table: {key: rows of state[src]}} for `keys` {key: src}
        (src "state1" or "state2"), copied to the CPU."""
        state = self.optimizer_state()
        return {t.name: {key: state[src][start:start + t.num_embeddings].detach().cpu().clone()
                         for key, src in keys.items()}
                for t, start in zip(self.tables, self.offsets.tolist())}

    def table_state(self, name: str, src: str) -> torch.Tensor:
        """`state[src]` ("state1" or "state2") rows of one table, copied to the CPU (what a
        checkpoint writes, one table and one state at a time)."""
        start, rows = self._span(name)
        return self.optimizer_state()[src][start:start + rows].detach().to("cpu", copy=True)  # one copy, CPU or GPU

    @torch.no_grad()
    def load_table_states(self, keys: dict[str, str], tables: dict[str, dict[str, torch.Tensor]],
                          steps: float) -> None:
        """Inverse of `table_states`; `steps` is the optimizer's step count (Adam's bias correction)."""
        state = self.optimizer_state()
        state["hyper"][1].fill_(float(steps))
        for t, start in zip(self.tables, self.offsets.tolist()):
            for key, src in keys.items():
                state[src][start:start + t.num_embeddings].copy_(tables[t.name][key])


def _capturing(ids: torch.Tensor) -> bool:
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


def _init_weights(tables: list[TableConfig], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All tables in one [R, D] buffer, each drawn like `init_table` (on `device`'s own generator)."""
    rows = sum(t.num_embeddings for t in tables)
    weight = torch.empty(rows, tables[0].embedding_dim, dtype=dtype, device=device)
    if device.type == "meta":
        return weight
    start = 0
    for index, t in enumerate(tables):
        block = weight[start:start + t.num_embeddings]
        start += t.num_embeddings
        if device.type == "cpu":  # the plain collection's numbers
            block.copy_(init_table(t, seed, index))
            continue
        if t.init == "zeros":
            block.zero_()
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1000003 + index)
        bound = 1.0 / math.sqrt(t.num_embeddings)
        if dtype == torch.float32:
            block.uniform_(-bound, bound, generator=gen)
        else:
            block.copy_(torch.empty(block.shape, device=device).uniform_(-bound, bound, generator=gen))
    return weight
