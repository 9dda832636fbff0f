"""A training batch on the host or a device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """`dense` [B, num_dense] float32, `sparse` [B, slots] int64 ids (each sparse feature's `width`
    slots in feature order: `ctrflow.contract.features`), `labels` [B] float32. Criteo: [B, 13] and [B, 26]."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Copy to a device; with pinned memory and `non_blocking`, the copy overlaps compute."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """Page-locked copies, so host-to-device transfers can be asynchronous."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def __len__(self) -> int:
        return self.labels.shape[0]
