"""`FusedShardedEmbeddingCollection`: the hybrid-parallel lookup on the fused kernels.

Each rank keeps its model-parallel shards (whole tables, and row-wise pieces with shard-local ids)
in one `FusedEmbeddingCollection` buffer and the replicated (data-parallel) tables in another.
Forward: ids all-to-all (`routing.route`) -> one fused lookup of every received id -> multi-hot bags
pooled by their owner (`ctrflow.embedding.bags` says why there: with whole tables only, the received
ids are a batch of world * b samples of the owner's tables, pooled by the one-GPU bag kernel and
updated by its backward; with row pieces, `owner_pool.py`) -> vectors
all-to-all (in the output dtype, bf16 on the fast path) -> assembled [b, T, D] (a row-split bag's
partial sums added); replicated tables are looked up and pooled locally. One-hot tables take exactly
the path they took before bags existed (same sizes, no pooling step). Backward: the gradients travel
back the same way (a bag's spread over its ids by the owner) and feed the fused sort/segment-sum +
optimizer update, scaled by 1/world (so N ranks equal one process fed the global batch, like DDP's
averaging of the dense gradients); replicated tables' gradients are summed densely over ranks (one
all-reduce) and stepped identically everywhere. No sparse gradient exists.

With several ranks the backward only starts its exchanges (asynchronous) and the update waits until
the end of the backward pass (an autograd callback; or the caller's `flush()` with
`update_in_backward = False`), so the all-to-all overlaps the rest of the backward (bottom MLP,
DDP's all-reduce); `flush()` also runs before the next lookup (that half: `sharded_update.py`).
`prefetch(chunks)` starts a step's lookups and exchanges ahead of its forwards (micro-batches whose
gradients still make ONE update; `next_ids`: the next step's ids all-to-all runs during this one;
`work_ahead`: the update's sorts and the replicas' zeroed sums are done in forward, while the
exchange travels), and `raw_output` hands the exchange buffer itself to a reader that knows
`exchange_rows()` (`ctrflow.accel.exchange`: DLRM's fused interaction; one-hot collections only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.embedding.bags import check_slot_ids, one_id_tables
from ctrflow.embedding.collection import copy_table_rows
from ctrflow.embedding.comm import exchange_async, group_size
from ctrflow.embedding.fused import bags, ops
from ctrflow.embedding.fused.collection import FusedEmbeddingCollection
from ctrflow.embedding.fused.placement import add_row_bags, place_index
from ctrflow.embedding.fused.routing import Layout, Route, empty_route, route, start_route
from ctrflow.embedding.fused.sharded_state import WholeTables
from ctrflow.embedding.fused.sharded_update import DeferredUpdate
from ctrflow.embedding.plan import ShardingPlan
from ctrflow.embedding.tables import TableConfig


class _ShardedLookup(torch.autograd.Function):
    """ids -> [b, T, D]; backward hands the gradient to the collection, which updates itself."""

    @staticmethod
    def forward(ctx, ids, anchor, coll):
        out, saved = coll.lookup(ids)
        ctx.coll, ctx.saved = coll, saved
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.coll.start_backward(grad, ctx.saved)
        return None, None, None


class FusedShardedEmbeddingCollection(DeferredUpdate, WholeTables, nn.Module):
    """ids [b, S] of this rank's samples -> [b, T, D], tables placed by a table/row/data `ShardingPlan`,
    trained in backward by the fused `optimizer` ("sgd", "rowwise_adagrad", "adam"); a collective.

    Whole tables and optimizer state go through `full_weights()` / `table_states()` (collectives)
    and `load_full_weights()` / `load_table_states()`, so checkpoints are topology-independent.
    Local weights are drawn like `FusedEmbeddingCollection`'s (per local table; row pieces bounded
    by their own row count); `from_collection` copies a plain collection's instead.
    """

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, group=None, device="cpu",
                 optimizer: str = "sgd", lr: float = 0.01, output_dtype: torch.dtype = torch.float32,
                 storage_dtype: torch.dtype = torch.float32, seed: int = 0, check: bool = True,
                 pre_reduce: bool = True, overlap: bool = True, **optim):
        super().__init__()
        self.tables, self.plan, self.group = list(tables), plan, group
        self.embedding_dim = tables[0].embedding_dim
        self.world_size = group_size(group)
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, process group has {self.world_size}")
        self.layout = Layout(self.tables, plan, self.rank)
        self.output_dtype, self.check, self.overlap = output_dtype, check, overlap
        options = dict(optimizer=optimizer, lr=lr, storage_dtype=storage_dtype, output_dtype=output_dtype,
                       device=device, check_ids=False, pre_reduce=pre_reduce, **optim)
        lay = self.layout
        self.local = (FusedEmbeddingCollection(lay.local_tables, seed=seed * 7919 + self.rank + 1, **options)
                      if lay.local_tables else None)
        self.replica = (FusedEmbeddingCollection(one_id_tables([self.tables[f] for f in lay.rep]), seed=seed,
                                                 **options) if lay.rep else None)
        for d, cols in enumerate(lay.tab_cols):  # the id columns each rank's whole tables take
            self.register_buffer(f"tab_index_{d}", torch.tensor(cols, dtype=torch.int64, device=device),
                                 persistent=False)
        self.register_buffer("rep_index", torch.tensor(lay.rep_cols, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("zero_offset", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        # the bag kernels' view of this rank's whole tables and of the replicas: the bags they are
        if lay.owner_bags:
            self._register_bags("owner", lay.tab[self.rank], self.local.offsets[:len(lay.tab[self.rank])], device)
        if lay.rep_bags:
            self._register_bags("rep", lay.rep, self.replica.offsets, device)
        self.model_parallel = any(lay.tab) or bool(lay.row_feats)
        self.pending: list[dict] = []  # steps whose backward exchanges started, update not applied
        self.ready: list[dict] = []  # prefetched chunks whose forward has not run
        self.ahead = None  # (route, work): the next step's ids all-to-all, started during this step
        self.next_route: Route | None = None  # its result, taken by the next `prefetch`
        self.raw_output = False  # return the exchange's buffer as is (`read_exchange_layout`)
        # False: backward only starts the exchanges; the caller's flush() (or the next lookup) updates,
        # e.g. after starting its own all-reduce of the dense gradients, which then overlaps the update
        self.update_in_backward = True
        # forward also does what backward needs from the ids alone, while the exchange travels: the
        # update's sorts of the step's rows and the zeroing of the replicas' gradient sums
        self.work_ahead = True
        # several CUDA ranks whose caller flushes: the tables' own work (those sorts, the replicas' sums and
        # all-reduce, the update) on a side stream, beside the dense layers, joined by `flush()`
        self.beside = True
        self.cache: dict = {}

    @classmethod
    def from_collection(cls, collection, plan: ShardingPlan, group=None, device="cpu", **options):
        """Shard a plain (or fused) collection, keeping its current weights."""
        sharded = cls(collection.tables, plan, group, device, **options)
        index = {t.name: i for i, t in enumerate(collection.tables)}
        with torch.no_grad():  # shard by shard, in chunks: a deferred collection is never whole
            for name, (coll, start, rows) in sharded._parts().items():
                copy_table_rows(collection, index[name], rows[0], rows[1],
                                coll.weight[start:start + rows[1] - rows[0]])
        return sharded

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.cache.clear()
        self.ahead = self.next_route = None
        return self

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """No trainable parameters: the tables update themselves in backward."""
        return {}

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next steps (a device write, no sync)."""
        for coll in (self.local, self.replica):
            if coll is not None:
                coll.set_lr(lr)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, S] -> [b, T, D] (every rank calls it each step; a micro-batch given to
        `prefetch` takes the lookups and exchanges already started for it)."""
        if self.check:
            check_slot_ids(ids, self.tables)
        anchor = ids.new_empty(0, dtype=torch.float32).requires_grad_(torch.is_grad_enabled())
        return _ShardedLookup.apply(ids, anchor, self)

    def prefetch(self, chunks: list[torch.Tensor], next_ids: torch.Tensor | None = None) -> None:
        """Start one step's lookups and embedding exchanges for its micro-batches `chunks` (ids [b_c, S]
        each), all before any of their dense compute, so chunk c+1's exchange runs under chunk c's
        dense layers; `forward(chunks[c])` must follow for each c, in order. Their gradients are
        summed into ONE optimizer update (exact for every optimizer: the step of the whole batch).
        `next_ids` (static plans, one chunk): the ids of the NEXT step, whose all-to-all then runs
        during this step (finished by `flush()`); the next `prefetch` takes that routing instead of
        exchanging its own ids, so its ids must equal `next_ids`."""
        self.flush()  # the last backward's update lands before these lookups
        lay, dim = self.layout, self.embedding_dim
        ahead, self.next_route = self.next_route, None
        if self.model_parallel and ahead is not None and len(chunks) == 1 and ahead.batch == chunks[0].shape[0]:
            routes = [ahead]
        elif self.model_parallel:
            offsets = self.local.offsets if self.local is not None else None
            routes = [route(ids, lay, offsets, self.group, self.cache, self._tab_indices()) for ids in chunks]
        else:
            routes = [empty_route(ids.shape[0], ids, lay.world) for ids in chunks]
        bounds, back = [0], [0]  # per chunk: its received ids, and the vectors it returns (its gradient rows)
        for r in routes:
            bounds.append(bounds[-1] + r.rows.numel())
            back.append(back[-1] + sum(r.back_out))
        rows = routes[0].rows if len(routes) == 1 else torch.cat([r.rows for r in routes])
        step = {"rows": rows, "bounds": bounds, "back": back, "pools": [r.pool for r in routes],
                "chunks": len(chunks), "arrived": 0, "works": [], "grad": None, "bag_ids": [], "scales": [],
                "rep_acc": None, "rep_work": None, "sorted": None, "rep_sorted": [None] * len(chunks),
                "rep_scales": [None] * len(chunks),
                "rep_ids": [None] * len(chunks)}
        if self.local is not None and rows.numel() and not lay.owner_bags:  # one gather for every chunk's ids
            dtype = torch.float32 if lay.pools else self.output_dtype  # bags are summed from fp32 rows
            emb = ops.lookup(rows.view(-1, 1), self.zero_offset, self.local.weight, dtype).view(-1, dim)
        else:
            emb = None
        self.ready = [self._start_exchange(ids, r, emb, step, c) for c, (ids, r) in enumerate(zip(chunks, routes))]
        rep = self.replica
        if rep is not None:  # their lookups wait for `lookup`, so the bottom MLP is not queued behind them
            step["rep_ids"] = [ids.index_select(1, self.rep_index) for ids in chunks]
        if self.work_ahead and torch.is_grad_enabled():
            # while the embeddings travel, beside the bottom MLP: work only the update needs
            with self._beside(rows, *(step["rep_ids"] if rep is not None else [])):
                if rep is not None:
                    step["rep_acc"] = self._replica_sums()
                for c, chunk_ids in enumerate(step["rep_ids"] if rep is not None and self._sort_ahead() else []):
                    step["rep_sorted"][c] = ops.sort_rows((chunk_ids + self.rep_offsets()).reshape(-1),
                                                          rep.weight.shape[0])
                if self._sort_ahead() and self.local is not None and rows.numel():
                    step["sorted"] = ops.sort_rows(rows, self.local.weight.shape[0])
        if next_ids is not None and self.model_parallel and lay.static and len(chunks) == 1:
            # queued behind this step's exchanges; finished by `flush()` at the end of the step
            with self._beside(next_ids):
                self.ahead = start_route(next_ids, lay, self.group, self._tab_indices())

    def _start_exchange(self, ids: torch.Tensor, r: Route, emb, step: dict, c: int) -> dict:
        """Chunk c's returned vectors (its bags pooled first), started into the head of its source
        buffer (whose tail takes its replicated lookups)."""
        n_back, b, dim = sum(r.back_in), ids.shape[0], self.embedding_dim
        src = torch.empty(n_back + b * len(self.layout.rep), dim, dtype=self.output_dtype, device=ids.device)
        work = None
        if self.model_parallel:
            if self.layout.owner_bags and self.local is not None:
                piece = self._pool_owned(r, step)
            else:
                lo, hi = step["bounds"][c], step["bounds"][c + 1]
                piece = emb[lo:hi] if emb is not None else src.new_empty(0, dim)
            if r.pool is not None:
                piece = r.pool.pool(piece).to(self.output_dtype)
            _, work = exchange_async(piece, r.back_in, r.back_out, self.group, out=src[:n_back])
        return {"ids": ids, "route": r, "src": src, "work": work, "n_back": n_back, "step": step, "chunk": c}

    def _pool_owned(self, r: Route, step: dict) -> torch.Tensor:
        """`layout.owner_bags`: the vectors to send back [world * b * tables, D], pooled by the bag
        kernel from the received ids read as a batch [world * b, columns] of this rank's tables (each
        source's [b, columns] in turn: the order the vectors go back); the ids and their weights in
        their bags are kept for the update."""
        ids = r.ids.view(-1, len(self.layout.tab_cols[self.rank]))
        # scales always: a lookup not prefetched runs inside autograd's forward, where grad mode is off
        out, scales = bags.lookup_bags(ids, self.bag_layout("owner"), self.local.weight, self.output_dtype,
                                       save_scales=True)
        step["bag_ids"].append(ids)
        step["scales"].append(scales)
        return out.view(-1, self.embedding_dim)

    def _register_bags(self, prefix: str, feats: list[int], offsets: torch.Tensor, device) -> None:
        """Buffers of the `bags.BagLayout` of tables `feats` starting at buffer rows `offsets`."""
        for name, tensor in bags.layout_tensors([self.tables[f] for f in feats], offsets.tolist()).items():
            self.register_buffer(f"{prefix}_bag_{name}", tensor.to(device), persistent=False)

    def bag_layout(self, prefix: str) -> bags.BagLayout:
        """Where this rank's whole tables ("owner": `layout.owner_bags`) or the replicas ("rep") lie in
        their buffer, as bags."""
        feats = self.layout.tab[self.rank] if prefix == "owner" else self.layout.rep
        keys = ("slot_offsets", "slot_table", "table_start", "table_length", "table_mode", "table_offset")
        return bags.BagLayout(tuple(self.tables[f] for f in feats), *(getattr(self, f"{prefix}_bag_{k}") for k in keys))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The forward of one (micro-)batch; returns the output and what backward needs.

        The returned embeddings and the replicated lookups land in one source buffer, and one
        gather (`place_index`) writes [b, T, D] from it: no per-feature copies (none at all with
        `raw_output`: the buffer itself is returned)."""
        if not self.ready or self.ready[0]["ids"] is not ids:
            self.prefetch([ids])
        entry = self.ready.pop(0)
        b, c = ids.shape[0], entry["chunk"]
        if self.replica is not None and b:  # while the exchange still travels
            entry["step"]["rep_scales"][c] = self._lookup_replicas(
                entry["step"]["rep_ids"][c], entry["src"][entry["n_back"]:].view(b, len(self.layout.rep),
                                                                                  self.embedding_dim))
        if entry["work"] is not None:
            entry["work"].wait()
        r = entry["route"]
        if self.raw_output:  # [b, T, D] in name only: rows laid out as `exchange_rows` says
            out = entry["src"].view(ids.shape[0], len(self.tables), self.embedding_dim)
        else:
            perm = place_index(self.layout, r, len(self.tables), entry["n_back"], ids.device, self.cache)
            out = ops.lookup(perm, self.zero_offsets(len(self.tables)), entry["src"], self.output_dtype)
            if self.layout.bag_rows:
                add_row_bags(out, entry["src"], self.layout, r, ids)
        return out, (ids, r, entry["step"], entry["chunk"])

    def _lookup_replicas(self, rep_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """The replicated tables' vectors of ids [b, columns] into `out` [b, n_rep, D]; with bags (pooled
        by the bag kernel) returns each id's weight in its bag [b, columns] for the update."""
        rep = self.replica
        if not self.layout.rep_bags:
            ops.lookup(rep_ids, rep.offsets, rep.weight, self.output_dtype, out=out)
            return None
        return bags.lookup_bags(rep_ids, self.bag_layout("rep"), rep.weight, self.output_dtype, save_scales=True,
                                out=out)[1]

    def rep_offsets(self) -> torch.Tensor:
        """Each replicated id column's first row in the replica buffer (one per table without bags)."""
        return self.rep_bag_slot_offsets if self.layout.rep_bags else self.replica.offsets

    def exchange_rows(self) -> torch.Tensor | None:
        """[3, F] int64: feature f of sample b of a (micro-)batch of b_n samples sits at row
        b_n * rows[0, f] + b * rows[1, f] + rows[2, f] of the forward's source buffer (the returned
        embeddings, in the order their ids were sent, then the replicated lookups [b_n, n_rep]);
        None where row-wise shards make the layout depend on the ids, or where multi-hot tables
        are (the interaction reads one-hot collections' buffers only)."""
        lay = self.layout
        if not lay.static or not lay.one_hot:
            return None
        rows = torch.zeros(3, len(self.tables), dtype=torch.int64)
        start = 0
        for group in (*lay.tab, lay.rep):
            for k, f in enumerate(group):
                rows[:, f] = torch.tensor([start, len(group), k])
            start += len(group)
        return rows.to(self.local_device())

    def zero_offsets(self, n: int) -> torch.Tensor:
        """n zeros (the gather's per-feature offsets when it reads a plain row buffer)."""
        if ("zeros", n) not in self.cache:
            self.cache["zeros", n] = torch.zeros(n, dtype=torch.int64, device=self.local_device())
        return self.cache["zeros", n]

    def _tab_indices(self) -> list[torch.Tensor]:
        return [getattr(self, f"tab_index_{d}") for d in range(self.world_size)]

    def _sort_ahead(self) -> bool:
        """Whether to sort the step's rows for the update in forward, while the exchange travels (a
        training step on the GPU kernels; `prefetch` runs in the caller's grad mode)."""
        return self.work_ahead and torch.is_grad_enabled() and ops.uses_kernels((self.local or self.replica).weight)

    def local_device(self) -> torch.device:
        """The device of this rank's buffers."""
        return self.zero_offset.device
