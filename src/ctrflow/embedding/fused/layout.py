"""Where every table of a hybrid-parallel plan lives, for the fused sharded collection (`Layout`)."""

from __future__ import annotations

from ctrflow.embedding.bags import is_bag, one_id_tables, slot_columns
from ctrflow.embedding.plan import ShardingPlan
from ctrflow.embedding.pooling import is_one_hot
from ctrflow.embedding.tables import TableConfig


class Layout:
    """Per rank of the plan: the tables it holds whole (`tab`, and their id columns `tab_cols`), the
    row-wise shards it holds (`row_slots`: (table, shard)), and the replicated tables (`rep`,
    `rep_cols`); this rank's local tables (its whole tables first, then its row pieces) for one fused
    buffer. The same on every rank. Tables index the output [b, T, D]; columns the ids [b, S] (one per
    one-hot table, `length` per multi-hot bag)."""

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, rank: int):
        world = plan.world_size
        kinds = [plan.tables[t.name].sharding for t in tables]
        column = [t.name for t, k in zip(tables, kinds) if k == "column"]
        if column:
            raise ValueError(f"the fused sharded path has no column-wise sharding (tables {', '.join(column)})")
        self.world, self.rank, self.tables = world, rank, list(tables)
        self.columns = slot_columns(tables)
        self.one_hot = is_one_hot(tables)  # then columns are tables: everything travels as before bags existed
        self.tab = [[f for f, t in enumerate(tables) if kinds[f] == "table" and plan.tables[t.name].shards[0].rank == d]
                    for d in range(world)]
        self.tab_cols = [self.cols_of(feats) for feats in self.tab]
        self.row_feats = [f for f, k in enumerate(kinds) if k == "row"]
        self.row_shards = {f: sorted(plan.tables[tables[f].name].shards, key=lambda s: s.rows[0])
                           for f in self.row_feats}
        self.row_slots = [[(f, s) for f in self.row_feats for s in self.row_shards[f] if s.rank == d]
                          for d in range(world)]
        self.bag_rows = [f for f in self.row_feats if is_bag(tables[f])]  # pooled partially, per shard
        self.rep = [f for f, k in enumerate(kinds) if k == "data"]
        self.rep_cols = self.cols_of(self.rep)
        self.rep_bags = any(is_bag(tables[f]) for f in self.rep)
        mine = self.tab[rank]
        # this rank's whole tables' columns: the local table of each, and whether it is a bag's slot
        self.tab_slot_table = [k for k, f in enumerate(mine) for _ in range(tables[f].length)]
        self.tab_bag_slot = [is_bag(tables[f]) for f in mine for _ in range(tables[f].length)]
        self.tab_mean = [tables[f].pooling == "mean" for f in mine]
        # whether this rank pools what it receives (a bag among its whole tables or its row pieces)
        self.pools = any(self.tab_bag_slot) or any(f in self.bag_rows for f, _ in self.row_slots[rank])
        self.local_tables = one_id_tables([tables[f] for f in mine]) + [
            TableConfig(f"{tables[f].name}[{s.rows[0]}:{s.rows[1]}]", s.num_rows, tables[f].embedding_dim,
                        tables[f].feature, init_scale=tables[f].init_scale) for f, s in self.row_slots[rank]]
        # for each local table: (table name, the rows of the whole table it holds)
        self.local_parts = [(tables[f].name, (0, tables[f].num_embeddings)) for f in mine] + [
            (tables[f].name, s.rows) for f, s in self.row_slots[rank]]

    def cols_of(self, feats: list[int]) -> list[int]:
        """The id columns of tables `feats`, in their order."""
        return [c for f in feats for c in range(*self.columns[f])]

    @property
    def static(self) -> bool:
        """Whether split sizes follow from the batch size alone (no row-wise shards)."""
        return not self.row_feats

    @property
    def owner_bags(self) -> bool:
        """Whether this rank pools what it receives with the fused bag kernels: a static plan (every
        source sends [b, columns] of this rank's whole tables, together a batch of world * b samples
        for them) with a bag among those tables."""
        return self.static and self.pools
