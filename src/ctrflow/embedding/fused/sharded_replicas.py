"""The replicated (data-parallel) tables of `FusedShardedEmbeddingCollection`: their lookups,
gradient sums and update, by one of two exact schemes (`replica_update`):

- "all" (default): one all-reduce of the sums, every rank steps every row (`replicas.apply_replicated`);
- "sharded": the sums are reduce-scattered, each rank steps its 1/N of the rows, and the next step's
  lookups read a copy all-gathered in the lookup dtype (`replica_shards.ReplicaShards`).

Both run the collectives on the default group's communicator (beside the all-to-alls of the
collection's own group, not queued behind them). Equally fast on 4 H200s (`replica_shards.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ctrflow.embedding.fused import ops
from ctrflow.embedding.fused.replica_shards import ReplicaShards
from ctrflow.embedding.fused.replicas import apply_replicated, needs_counts, replicated_grad


class ReplicatedTables:
    """Mixin of the fused sharded collection (attributes `replica`, `shards`, `layout`, `world_size`,
    `rank`, `group`, `embedding_dim`, `output_dtype`, `rep_index`, `cache`; method `local_device`)."""

    def _replica_shards(self, update: str, comm: str, device) -> ReplicaShards | None:
        """The replicas' sharded update, or None ("all", one process, or no replicated table)."""
        if update not in ("sharded", "all") or comm not in ("fp32", "bf16"):
            raise ValueError(f"replica_update must be sharded or all, replica_comm fp32 or bf16; got {update!r}, "
                             f"{comm!r}")
        if comm == "bf16" and update != "sharded":
            raise ValueError("replica_comm='bf16' needs replica_update='sharded'")
        if self.replica is None or self.world_size == 1 or update == "all":
            return None
        return ReplicaShards(self.replica.weight.shape[0], self.embedding_dim, self.world_size, self.rank,
                             self._replica_group(), self.output_dtype,
                             torch.bfloat16 if comm == "bf16" else torch.float32, device)

    def _replica_group(self):
        """The group of the replicas' collectives: the default one when it spans the same ranks."""
        return None if self.world_size == dist.get_world_size() else self.group

    def _lookup_replicas(self, entry: dict, rep_ids: torch.Tensor, weight: torch.Tensor) -> None:
        """A chunk's replicated lookups (rep_ids [b, n_rep] of `weight`'s tables) into its source buffer's tail."""
        b, dim = rep_ids.shape[0], self.embedding_dim
        ops.lookup(rep_ids, self.replica.offsets, weight, self.output_dtype,
                   out=entry["src"][entry["n_back"]:].view(b, len(self.layout.rep), dim))

    def _sum_replicas(self, ids: torch.Tensor, grad: torch.Tensor, step: dict, c: int) -> None:
        """Add chunk c's replicated gradients (grad [b, n_rep, D] of ids [b, F]) to the step's sums."""
        rep = self.replica
        step["rep_acc"] = replicated_grad(ids.index_select(1, self.rep_index), rep.offsets, grad, self._replica_rows(),
                                          self.cache, counts=needs_counts(rep), out=step["rep_acc"],
                                          presorted=step["rep_sorted"][c])

    def _start_replica_reduce(self, step: dict) -> None:
        """Start the step's reduction of the replicas' sums over ranks (asynchronous)."""
        if self.shards is not None:
            step["rep_works"] = self.shards.start_reduce(step["rep_acc"], needs_counts(self.replica))
        elif self.replica is not None and self.world_size > 1:
            step["rep_works"] = [dist.all_reduce(step["rep_acc"], group=self._replica_group(), async_op=True)]

    def _apply_replica_update(self, step: dict) -> None:
        """The replicas' optimizer step (waits for the reduction): this rank's rows, or all of them."""
        for work in step["rep_works"]:
            work.wait()
        if step["rep_acc"] is not None and self.shards is not None:
            self.shards.apply(self.replica, needs_counts(self.replica))
        elif step["rep_acc"] is not None:
            apply_replicated(step["rep_acc"], self.replica, self.world_size)

    def _replica_sums(self) -> torch.Tensor:
        """The zeroed [rows * (D + 1)] fp32 buffer of `replicated_grad` (one, reused every step)."""
        buf = self.cache.get("rep_acc")
        if buf is None:
            buf = self.cache["rep_acc"] = torch.empty(self._replica_rows() * (self.embedding_dim + 1),
                                                      dtype=torch.float32, device=self.local_device())
        return buf.zero_()

    def _replica_rows(self) -> int:
        """Rows of the replicas' gradient sums: the replica's, padded to a multiple of the ranks when sharded."""
        return self.shards.padded if self.shards is not None else self.replica.weight.shape[0]
