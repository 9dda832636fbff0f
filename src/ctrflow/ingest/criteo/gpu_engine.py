"""`--engine gpu`: parse, count and transform on one torch device, in this process.

Fit: each group of blocks (`gpu_read`) is parsed on the device (`gpu_parse`); a block with any line the
device parser does not take is parsed by the CPU engine's parser instead (same problems, same
line numbers, same skip accounting); its valid rows join the device rows. Training values are counted
with `torch.unique` on (column, value) keys, merged across groups. The parsed columns stay on the
device between the passes while they fit (`resident_bytes`), else in host memory.
Vocabulary: values reaching the threshold, ranked on the device as the CPU engine orders them (count
descending, ties by value bytes); its tables are built on the CPU beside the transform. Transform: ids
by `searchsorted` on the device, then the Parquet parts of the CPU engine's blocks, written by threads.
Inputs whose categorical values are not all 8 lowercase hex digits raise `UnsupportedInput`: the caller
runs the CPU engine instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ctrflow.ingest.criteo import gpu_read
from ctrflow.ingest.blocks import read_block
from ctrflow.ingest.criteo.raw import count_lines, line_starts, parse_block
from ctrflow.contract.kernels import _LOG1P_TABLE, LOG1P_TABLE_SIZE, dense_inputs
from ctrflow.ingest.criteo.gpu_parse import HEX_DIGITS, Tables, hex_values, parse_lines
from ctrflow.ingest.criteo.gpu_read import Group, GroupReader
from ctrflow.ingest.output import part_schema, write_part
from ctrflow.ingest.split import rows_in_valid
from ctrflow.contract.schema import FIRST_ID, LABEL, MISSING_ID, OOV_ID
from ctrflow.contract.criteo import DENSE, SPARSE, criteo_features
from ctrflow.contract.vocab import encode_keys, keys_to_strings
from ctrflow.errors import UserError

COLUMN_SHIFT = 32  # (column, value) key: column << 32 | value
_PART_SCHEMA = part_schema(criteo_features(dict.fromkeys(SPARSE, 0)))


class UnsupportedInput(Exception):
    """The input has values the device path does not represent (e.g. C values not 8 hex digits)."""


@dataclass
class Rows:
    """A group's valid rows (device or host tensors) and, per block, its row range and accounting."""

    label: object  # float32 [R]
    dense: object  # float32 [13, R]
    sparse: object  # int64 [26, R], -1 = missing
    valid: np.ndarray | None  # bool [R]: the row goes to the validation split (None: the file's split)
    split: str
    ranges: list[tuple[int, int]] = field(default_factory=list)  # per block: rows [a, b)


def _hex_keys(strings) -> np.ndarray:
    keys, other = encode_keys(strings)
    values = None if other is not None else hex_values(keys)
    if values is None:
        raise UnsupportedInput("categorical values other than 8 lowercase hex digits")
    return values


class GpuEngine:
    """The device pipeline of one preprocess run (see the module docstring)."""

    def __init__(self, device: str, paths: dict[int, str], splits: dict[int, str], fraction: float, seed: int,
                 stop_at_bad_row: bool, threads: int):
        try:
            import torch
        except ImportError:
            raise UserError("--engine gpu needs torch installed") from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--engine gpu --device {device}: no CUDA GPU visible here (use --device cpu)")
        self.torch, self.device = torch, torch.device(device)
        self.paths, self.splits, self.fraction, self.seed = paths, splits, fraction, seed
        self.stop_at_bad_row, self.threads = stop_at_bad_row, threads
        self.tables = Tables(torch, self.device)
        self.hex_digits = torch.from_numpy(HEX_DIGITS.copy()).to(self.device)
        self.log1p = torch.from_numpy(_LOG1P_TABLE).to(self.device)
        self.columns = torch.arange(len(SPARSE), device=self.device, dtype=torch.int64).unsqueeze(1) << COLUMN_SHIFT
        self.keys = torch.zeros(0, dtype=torch.int64, device=self.device)  # counted (column, value) keys, sorted
        self.counts = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.resident_bytes = self._memory_budget()
        self.reader = GroupReader(torch, self.device.type == "cuda", threads)

    def _memory_budget(self) -> int:
        if self.device.type != "cuda":
            return 1 << 62  # host memory either way
        free, _ = self.torch.cuda.mem_get_info(self.device)
        return free // 3  # the rest: one group's parse, the counts, the transform

    def fit(self, block_bytes: dict[int, int]):
        """Yield (group Rows, per-block accounting dicts) for every group, in input order."""
        used = 0
        for group in self.reader.groups(self.paths, block_bytes, gpu_read.GROUP_BYTES):
            if group.truncated is not None:
                tail = group.truncated.data
                yield None, [_result(group.file_index, count_lines(tail), truncated=True, tail=tail)]
                continue
            rows, results = self._fit_group(group)
            size = sum(t.numel() * t.element_size() for t in (rows.label, rows.dense, rows.sparse))
            if used + size > self.resident_bytes:  # keep what fits on the device, the rest in host memory
                rows.label, rows.dense, rows.sparse = rows.label.cpu(), rows.dense.cpu(), rows.sparse.cpu()
            else:
                used += size
            yield rows, results

    def _fit_group(self, group: Group) -> tuple[Rows, list[dict]]:
        torch = self.torch
        nblocks = len(group.blocks)
        buf = group.host[:group.size].to(self.device)
        lines = parse_lines(torch, self.tables, buf)
        starts = lines.starts + group.begin  # int64 [lines]: offsets in the file
        block_at = torch.tensor([b.start for b in group.blocks], dtype=torch.int64, device=self.device)
        block_of = torch.searchsorted(block_at, starts, right=True) - 1
        flagged = torch.zeros(nblocks, dtype=torch.bool, device=self.device)
        flagged[block_of[lines.flagged]] = True
        keep = ~flagged[block_of]
        per_block = torch.bincount(block_of, minlength=nblocks).cpu().numpy()  # sync
        flagged = flagged.cpu().numpy()
        label, dense = lines.label[keep], lines.dense[:, keep]
        missing, sparse, row_block = lines.dense_missing[:, keep], lines.sparse[:, keep], block_of[keep]
        offsets = [starts[keep].cpu().numpy()] if self.splits[group.file_index] == "split" else []
        results, ranges, at, extra = [], [], 0, []
        for k, block in enumerate(group.blocks):
            if flagged[k]:
                result, parsed = self._fit_on_cpu(group, block)
                results.append(result)
                extra.append((k, parsed))
                ranges.append(None)
            else:
                results.append(_result(group.file_index, int(per_block[k])))
                ranges.append((at, at + int(per_block[k])))
                at += int(per_block[k])
        for k, (label_k, dense_k, missing_k, sparse_k, offsets_k) in extra:
            n = len(label_k)
            label, dense = torch.cat([label, label_k]), torch.cat([dense, dense_k], 1)
            missing, sparse = torch.cat([missing, missing_k], 1), torch.cat([sparse, sparse_k], 1)
            row_block = torch.cat([row_block, torch.full((n,), k, dtype=torch.int64, device=self.device)])
            offsets.append(offsets_k)
            ranges[k] = (at, at + n)
            at += n
        rows = self._finish_group(group, results, ranges, label, dense, missing, sparse, row_block, offsets)
        return rows, results

    def _fit_on_cpu(self, group: Group, block) -> tuple[dict, tuple]:
        """The CPU engine's parse of one block: its accounting, and its valid rows as device tensors."""
        path = Path(self.paths[group.file_index])
        begin, data = read_block(path, block)
        parsed = parse_block(data)
        result = _result(group.file_index, parsed.lines, problems=parsed.problems)
        n = len(parsed.rows)
        if (parsed.problems and self.stop_at_bad_row) or n == 0:
            n, parsed = 0, None
        torch, to = self.torch, (lambda a: self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device))
        if parsed is None:
            empty = torch.zeros((0,), dtype=torch.int64, device=self.device)
            return result, (empty, empty.view(1, 0).repeat(len(DENSE), 1),
                            torch.zeros((len(DENSE), 0), dtype=torch.bool, device=self.device),
                            empty.view(1, 0).repeat(len(SPARSE), 1), np.zeros(0, np.int64))
        sparse = np.stack([_hex_keys(column) for column in parsed.sparse])
        missing = np.stack([column.is_null().to_numpy(zero_copy_only=False) for column in parsed.dense])
        offsets = line_starts(data)[parsed.rows] + begin
        return result, (to(parsed.label.astype(np.int64)), to(dense_inputs(parsed.dense)), to(missing),
                        to(sparse), offsets)

    def _finish_group(self, group, results, ranges, label, dense, missing, sparse, row_block, offsets) -> Rows:
        """Split, per-block rows and missing counts, training counts, dense transform."""
        torch = self.torch
        split = self.splits[group.file_index]
        valid = None
        if split == "split":
            valid = rows_in_valid(self.seed, group.file_index, np.concatenate(offsets), self.fraction)
            train = torch.from_numpy(~valid).to(self.device)
        else:
            train = torch.full((len(label),), split == "train", dtype=torch.bool, device=self.device)
        nblocks = len(group.blocks)
        absent = torch.cat([missing, sparse < 0]).to(torch.int64)  # [39, R]
        per_block_missing = torch.zeros((nblocks, absent.shape[0]), dtype=torch.int64, device=self.device)
        per_block_missing.index_add_(0, row_block, absent.t())
        per_block_valid = torch.bincount(row_block[~train], minlength=nblocks).cpu().numpy()
        per_block_missing = per_block_missing.cpu().numpy()
        label_sums = torch.zeros(nblocks, dtype=torch.int64, device=self.device)  # training labels: the label rate
        label_sums.index_add_(0, row_block[train], label[train].to(torch.int64))
        label_sums = label_sums.cpu().numpy()
        for k, result in enumerate(results):
            n = ranges[k][1] - ranges[k][0]
            if n == 0:
                continue
            result["cache"] = k  # the block within its group: it has rows to write
            result["missing"] = per_block_missing[k]
            result["label_sum"] = int(label_sums[k])
            v = int(per_block_valid[k])
            result["rows"] = {"train": n - v, "valid": v} if split == "split" else {"train": 0, "valid": 0, split: n}
        self._count(sparse, train)
        return Rows(label.to(torch.float32), self._transform_dense(dense), sparse, valid, split, ranges)

    def _count(self, sparse, train) -> None:
        """Add the training rows' (column, value) counts to the running totals."""
        torch = self.torch
        present = (sparse >= 0) & train.unsqueeze(0)
        keys, counts = torch.unique((sparse + self.columns)[present], return_counts=True)
        merged, inverse = torch.unique(torch.cat([self.keys, keys]), return_inverse=True)
        totals = torch.zeros(len(merged), dtype=torch.int64, device=self.device)
        self.counts = totals.index_add_(0, inverse, torch.cat([self.counts, counts]))
        self.keys = merged

    def _transform_dense(self, raw):
        """int64 [13, R] → float32: log1p(max(x, 0)), the CPU engine's table then float64 log1p (same bits)."""
        out = self.log1p[raw.clamp(0, LOG1P_TABLE_SIZE - 1)]
        large = raw >= LOG1P_TABLE_SIZE
        out[large] = self.torch.log1p(raw[large].to(self.torch.float64)).to(self.torch.float32)
        return out

    def order_vocabulary(self, threshold: int) -> tuple[np.ndarray, ...]:
        """Rank the values reaching `threshold` on the device and keep the id map `ids` uses: per column,
        count descending, ties by value (for 8 lowercase hex digits the numeric order is the strings' byte
        order, so this is the CPU engine's pyarrow sort). Returns host arrays for `vocabulary_tables`:
        (value string keys uint64 and counts, both in id order, column bounds [27], distinct [26])."""
        torch = self.torch
        distinct = torch.bincount(self.keys >> COLUMN_SHIFT, minlength=len(SPARSE))
        kept = self.counts >= threshold
        keys, counts = self.keys[kept], self.counts[kept]  # sorted by (column, value)
        by_count = torch.sort(-counts, stable=True).indices  # stable: equal counts stay in value order
        order = by_count[torch.sort(keys[by_count] >> COLUMN_SHIFT, stable=True).indices]  # then by column
        column = keys[order] >> COLUMN_SHIFT
        bounds = torch.searchsorted(column, torch.arange(len(SPARSE) + 1, device=self.device))
        ids = torch.empty(len(keys), dtype=torch.int32, device=self.device)
        ids[order] = (torch.arange(len(order), device=self.device) - bounds[column] + FIRST_ID).to(torch.int32)
        self.vocab_keys, self.vocab_ids = keys, ids
        shifts = torch.arange(28, -1, -4, device=self.device)  # most significant digit first: byte 0
        digits = self.hex_digits[(keys[order].unsqueeze(1) >> shifts) & 15]  # uint8 [V, 8]: the value strings
        digits, counts, bounds, distinct = self.to_host(digits, counts[order], bounds, distinct)
        return digits.view("<u8").reshape(-1), counts, bounds, distinct

    def ids(self, rows: Rows):
        """int32 [26, R] ids of a group's categorical values (a tensor on the device)."""
        torch = self.torch
        sparse = rows.sparse.to(self.device)
        keys = sparse + self.columns
        if len(self.vocab_keys) == 0:
            found = torch.full_like(keys, OOV_ID, dtype=torch.int32)
        else:
            pos = torch.searchsorted(self.vocab_keys, keys).clamp_(max=len(self.vocab_keys) - 1)
            hit = self.vocab_keys[pos] == keys
            found = torch.where(hit, self.vocab_ids[pos], torch.full_like(pos, OOV_ID, dtype=torch.int32))
        found[sparse < 0] = MISSING_ID
        return found

    def to_host(self, *tensors) -> list[np.ndarray]:
        """numpy copies of tensors. From a CUDA device through page-locked host tensors (several times the
        speed of copies to pageable memory); torch's caching host allocator hands the same page-locked
        blocks out again once the arrays (which hold their tensors) are dropped, so they are reused."""
        torch = self.torch
        if self.device.type != "cuda":
            return [t.cpu().numpy() for t in tensors]
        hosts = []
        for tensor in tensors:
            if tensor.device.type == "cpu":  # a group kept in host memory (`resident_bytes`)
                hosts.append(tensor)
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            hosts.append(host.copy_(tensor, non_blocking=True))
        torch.cuda.synchronize(self.device)  # sync: the copies above are done before numpy reads them
        return [host.numpy() for host in hosts]


def _result(file_index: int, lines: int, problems=(), truncated=False, tail=b"") -> dict:
    """A block's accounting, as the CPU engine's fit stage gives it (`accounting.account_block`)."""
    return {"file": file_index, "lines": lines, "rows": {"train": 0, "valid": 0}, "problems": list(problems),
            "truncated": truncated, "tail": tail, "cache": None,
            "missing": np.zeros(len(DENSE) + len(SPARSE), dtype=np.int64)}


def vocabulary_tables(ordered: tuple[np.ndarray, ...]) -> tuple[dict[str, pa.Table], dict[str, int]]:
    """`GpuEngine.order_vocabulary`'s arrays → ({column: table value/count in id order}, {column: distinct
    training values}); CPU work only (pyarrow casts), so it can run beside the transform."""
    keys, counts, bounds, distinct = ordered
    tables = {name: pa.table({"value": keys_to_strings(keys[bounds[j]:bounds[j + 1]]),
                              "count": pa.array(counts[bounds[j]:bounds[j + 1]].astype(np.int64))})
              for j, name in enumerate(SPARSE)}
    return tables, {name: int(distinct[j]) for j, name in enumerate(SPARSE)}


def write_parts(rows: Rows, ids: np.ndarray, label: np.ndarray, dense: np.ndarray, block: int,
                parts: dict[str, int], data_dir: str, compression: str) -> dict[str, int]:
    """One block's Parquet parts (as `passes.TransformStage` writes them); rows written per split."""
    a, b = rows.ranges[block]
    columns = {LABEL: label[a:b], **{name: dense[j, a:b] for j, name in enumerate(DENSE)},
               **{name: ids[j, a:b] for j, name in enumerate(SPARSE)}}
    written = {}
    for split, part in parts.items():
        part_rows = columns
        if rows.valid is not None:
            keep = rows.valid[a:b] if split == "valid" else ~rows.valid[a:b]
            part_rows = {name: values[keep] for name, values in columns.items()}
        out = os.path.join(data_dir, split, f"part-{part:05d}.parquet")
        written[split] = write_part(part_rows, out, compression, _PART_SCHEMA)
    return written
