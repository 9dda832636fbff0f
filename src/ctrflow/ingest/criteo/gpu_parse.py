"""Parse raw Criteo lines on a torch device (cuda or cpu), the way a GPU CSV reader does it.

A buffer of whole lines (uint8, ending with a newline) is split with vectorized ops: newline and
tab positions, then each row's 40 field boundaries; labels, I* (optional '-', up to 18 digits, or
empty) and C* (exactly 8 lowercase hex digits, or empty) are decoded with gathers, one character
position at a time. The device parser accepts only a strict subset of what the CPU parser accepts,
where both surely agree: any other line (a tab count other than 39, another byte, a label other than
0/1, a longer number, a C value of another form) is flagged, and the caller hands its block to the
CPU parser, so error messages and accounting stay the CPU engine's.

C values are kept as their hex value (uint32 in int64, -1 = missing): for 8 lowercase hex digits the
byte order of the strings is the numeric order, so sorting values sorts the strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctrflow.contract.criteo import DENSE, SPARSE

FIELDS = 1 + len(DENSE) + len(SPARSE)  # 40: label, I1..I13, C1..C26
MAX_DIGITS = 18  # every integer of up to 18 digits fits in int64
_ALLOWED = np.zeros(256, dtype=bool)
_ALLOWED[[9, 10, ord("-")] + list(range(ord("0"), ord("9") + 1)) + list(range(ord("a"), ord("f") + 1))] = True
_HEX = np.full(256, -1, dtype=np.int64)
_HEX[ord("0"):ord("9") + 1] = np.arange(10)
_HEX[ord("a"):ord("f") + 1] = np.arange(10, 16)
HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass
class DeviceLines:
    """One buffer's lines parsed on the device; rows of flagged lines hold arbitrary values."""

    starts: "torch.Tensor"  # int64 [lines]: byte offset of each line in the buffer
    flagged: "torch.Tensor"  # bool [lines]: the device parser does not take this line
    label: "torch.Tensor"  # int64 [lines] (0/1)
    dense: "torch.Tensor"  # int64 [13, lines], missing → 0
    dense_missing: "torch.Tensor"  # bool [13, lines]
    sparse: "torch.Tensor"  # int64 [26, lines]: hex value, -1 = missing


class Tables:
    """The byte-class tables on one device (built once per engine)."""

    def __init__(self, torch, device):
        self.allowed = torch.from_numpy(_ALLOWED).to(device)
        self.hex = torch.from_numpy(_HEX).to(device)


def _field_bounds(torch, buf, line_starts, line_ends):
    """(starts, ends) int64 [lines, 40] of every field, and the lines whose tab count is not 39."""
    lines = len(line_starts)
    tabs = torch.nonzero(buf == 9).squeeze(1)  # [T]
    tab_line = torch.searchsorted(line_ends, tabs)  # a tab belongs to the first line ending after it
    per_line = torch.bincount(tab_line, minlength=lines)
    first = torch.cumsum(per_line, 0) - per_line
    rank = torch.arange(len(tabs), device=buf.device) - first[tab_line]
    keep = rank < FIELDS - 1
    ends = line_ends.unsqueeze(1).repeat(1, FIELDS)
    ends[tab_line[keep], rank[keep]] = tabs[keep]
    starts = torch.empty_like(ends)
    starts[:, 0] = line_starts
    starts[:, 1:] = ends[:, :-1] + 1
    return starts, ends, per_line != FIELDS - 1


def _parse_integers(torch, buf, starts, lengths):
    """Optional '-' then 1..18 digits, or empty: (int64 values, 0 where empty; bad bool), same shape."""
    last = len(buf) - 1
    negative = (lengths > 0) & (buf[starts.clamp(max=last)] == ord("-"))
    first = starts + negative
    digits = lengths - negative.long()
    bad = (negative & (digits == 0)) | (digits > MAX_DIGITS)
    value = torch.zeros_like(starts)
    width = int(digits.clamp(max=MAX_DIGITS).max()) if digits.numel() else 0  # sync: the loop's length
    for k in range(width):
        active = digits > k
        digit = buf[(first + k).clamp(max=last)].long() - ord("0")
        bad |= active & ((digit < 0) | (digit > 9))
        value = torch.where(active, value * 10 + digit, value)
    return torch.where(negative, -value, value), bad


def _parse_hex8(torch, tables: Tables, buf, starts, lengths):
    """8 lowercase hex digits → value, empty → -1 (int64); bad bool where neither, same shape."""
    last = len(buf) - 1
    present = lengths == 8
    bad = (lengths != 0) & ~present
    value = torch.zeros_like(starts)
    for k in range(8):
        nibble = tables.hex[buf[(starts + k).clamp(max=last)].long()]
        bad |= present & (nibble < 0)
        value = value * 16 + nibble.clamp(min=0)
    return torch.where(present, value, torch.full_like(value, -1)), bad


def parse_lines(torch, tables: Tables, buf) -> DeviceLines:
    """Parse `buf` (uint8 [L] on the device, whole lines, the last one ending with a newline)."""
    line_ends = torch.nonzero(buf == 10).squeeze(1)  # [lines]
    line_starts = torch.cat([line_ends.new_zeros(1), line_ends[:-1] + 1]) if len(line_ends) else line_ends
    starts, ends, flagged = _field_bounds(torch, buf, line_starts, line_ends)
    lengths = (ends - starts).clamp(min=0)
    odd_bytes = torch.nonzero(~tables.allowed[buf.long()]).squeeze(1)  # few or none: sync-free when empty
    flagged[torch.searchsorted(line_ends, odd_bytes)] = True
    last = len(buf) - 1
    label = buf[starts[:, 0].clamp(max=last)].long() - ord("0")
    flagged |= (lengths[:, 0] != 1) | (label < 0) | (label > 1)
    dense_cols = slice(1, 1 + len(DENSE))
    dense, bad = _parse_integers(torch, buf, starts[:, dense_cols], lengths[:, dense_cols])
    flagged |= bad.any(1)
    sparse_cols = slice(1 + len(DENSE), FIELDS)
    sparse, bad = _parse_hex8(torch, tables, buf, starts[:, sparse_cols], lengths[:, sparse_cols])
    flagged |= bad.any(1)
    return DeviceLines(line_starts, flagged, label, dense.t().contiguous(),
                       (lengths[:, dense_cols] == 0).t().contiguous(), sparse.t().contiguous())


def hex_strings(values: np.ndarray) -> np.ndarray:
    """uint32 values (int64 array) → the uint64 keys of their 8 lowercase hex digits (`vocab.keys_to_strings`)."""
    shifts = np.arange(28, -1, -4, dtype=np.int64)  # most significant digit first: byte 0 of the string
    nibbles = (values.astype(np.int64)[:, None] >> shifts) & 15
    return np.ascontiguousarray(HEX_DIGITS[nibbles]).view("<u8").reshape(-1)


def hex_values(keys: np.ndarray) -> np.ndarray | None:
    """uint64 keys of 8-byte strings (`vocab.encode_keys`; 0 = missing) → hex value int64, -1 = missing;
    None when some string is not 8 lowercase hex digits."""
    raw = np.ascontiguousarray(keys, dtype="<u8").view(np.uint8).reshape(-1, 8)
    nibbles = _HEX[raw]
    present = keys != 0
    if (nibbles[present] < 0).any():
        return None
    value = np.zeros(len(keys), dtype=np.int64)
    for k in range(8):
        value = value * 16 + np.maximum(nibbles[:, k], 0)
    return np.where(present, value, -1)

