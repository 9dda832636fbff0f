"""The checkpoint face of `FusedShardedEmbeddingCollection`: whole tables and their optimizer state
by name, from (and back into) the shards each rank holds, so checkpoints cross topologies and paths.

Reading is collective (`gather_whole`: every rank calls it; under `gathered_on_main()` only rank 0
assembles). Loading takes whole tables and copies the rows this rank holds, so no rank ever gathers.
"""

from __future__ import annotations

import torch

from ctrflow.embedding.sharded import gather_whole


class WholeTables:
    """Mixin of the fused sharded collection (attributes `tables`, `plan`, `group`, `layout`, `local`,
    `replica`, and methods `flush`, `local_device`)."""

    def _parts(self) -> dict[str, tuple]:
        """Table name -> (local collection, first local row, rows of the whole table it holds)."""
        parts = {}
        if self.local is not None:
            for (name, rows), start in zip(self.layout.local_parts, self.local.offsets.tolist()):
                parts[name] = (self.local, start, rows)
        if self.replica is not None:
            for t, start in zip(self.replica.tables, self.replica.offsets.tolist()):
                parts[t.name] = (self.replica, start, (0, t.num_embeddings))
        return parts

    def _gather(self, read, per_row: bool = False, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Whole tables by name of `read(collection, start, n)`, a local [n, D] (or [n] with
        `per_row`) tensor, for every table or those in `names`; collective, on CPU."""
        self.flush()
        parts = self._parts()
        out = {}
        for t in self.tables:
            if names is not None and t.name not in names:
                continue
            local = None
            if t.name in parts:
                coll, start, rows = parts[t.name]
                local = read(coll, start, rows[1] - rows[0])
            out[t.name] = gather_whole(t, self.plan.tables[t.name], local, self.group, self.local_device(), per_row)
        return out

    def _optimizer(self) -> str:
        return (self.local or self.replica).row_state.optimizer

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name, on CPU (collective: every rank must call it)."""
        return self._gather(lambda coll, start, n: coll.weight[start:start + n])

    def full_table(self, name: str) -> torch.Tensor:
        """One whole table, on CPU (collective): checkpoints gather and write one table at a time."""
        return self._gather(lambda coll, start, n: coll.weight[start:start + n], names=(name,))[name]

    @torch.no_grad()
    def load_full_weights(self, tables: dict[str, torch.Tensor]) -> None:
        """Take whole tables by name (from a checkpoint of any topology, or a plain collection)."""
        for t in self.tables:
            if tuple(tables[t.name].shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"table {t.name}: got shape {tuple(tables[t.name].shape)}, "
                                 f"expected {(t.num_embeddings, t.embedding_dim)}")
        for name, (coll, start, rows) in self._parts().items():
            coll.weight[start:start + rows[1] - rows[0]].copy_(tables[name][rows[0]:rows[1]])

    def table_states(self, keys: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state as whole tables: {table: {key: state[src] rows}} for `keys` {key: src}
        (src "state1"/"state2" of the fused row state); collective, on CPU."""
        out: dict[str, dict[str, torch.Tensor]] = {t.name: {} for t in self.tables}
        for key, src in keys.items():
            for name, value in self._gather_state(src).items():
                out[name][key] = value
        return out

    def table_state(self, name: str, src: str) -> torch.Tensor:
        """`state[src]` of one whole table, on CPU (collective): one table and state at a time."""
        return self._gather_state(src, (name,))[name]

    def _gather_state(self, src: str, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        per_row = src == "state1" and self._optimizer() == "rowwise_adagrad"
        return self._gather(lambda coll, start, n: coll.optimizer_state()[src][start:start + n], per_row, names)

    @torch.no_grad()
    def load_table_states(self, keys: dict[str, str], tables: dict[str, dict[str, torch.Tensor]], steps: float) -> None:
        """Inverse of `table_states`; `steps` is the optimizer's step count (Adam's bias correction)."""
        for coll in (self.local, self.replica):
            if coll is not None:
                coll.optimizer_state()["hyper"][1].fill_(float(steps))
        for name, (coll, start, rows) in self._parts().items():
            for key, src in keys.items():
                coll.optimizer_state()[src][start:start + rows[1] - rows[0]].copy_(tables[name][key][rows[0]:rows[1]])
