"""A parsed block of a table → what the transform pass needs, and the training rows' value counts.

Categorical columns arrive dictionary-encoded (the block's distinct values and an index per row), so
counting is a bincount of the indices and the transform looks up only the dictionary. A multi-hot
column's distinct texts are split once (`contract.lists`): a row keeps an index to its text's list.
The cached block: label, transformed dense columns, each sparse column's row indices, the validation
flag (an Arrow table) beside each column's dictionary (`side`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.description import Description
from ctrflow.contract.features import LABEL
from ctrflow.contract.lists import Lists, split_lists
from ctrflow.contract.numbers import transform_dense
from ctrflow.ingest.table.lengths import report_lengths
from ctrflow.ingest.output import VALID



@dataclass
class EncodedBlock:
    """One block ready for the cache, and its accounting."""

    table: pa.Table  # label float32, dense float32, sparse int32 row indices, VALID (when split)
    side: dict  # categorical: name → dictionary (string); multi-hot: name → (values, codes [D, max_length])
    counts: dict  # name → (distinct values, int64 counts) of the training rows, missing values left out
    missing: np.ndarray  # int64 [dense + sparse]: missing values per feature column
    lists: dict  # multi-hot: name → its list lengths and likely separators (`lengths.report_lengths`)
    label_sum: int  # training rows labelled 1


def _dictionary(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """(int32 row indices, string dictionary) of a column, dictionary-encoding it if it is not already."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(pc.fill_null(column.cast(pa.string()), ""))
    elif column.null_count:
        column = pc.dictionary_encode(pc.fill_null(column.cast(column.type.value_type), ""))
    indices = column.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    dictionary = column.dictionary
    return indices, dictionary if dictionary.type == pa.string() else dictionary.cast(pa.string())


def encode_block(table: pa.Table, description: Description, valid: np.ndarray | None, split: str) -> EncodedBlock:
    """Encode the good rows of a block (`table`: as `text_parse`/`parquet_read` give them) of a file
    feeding `split` ("train", "valid", or "split" by `valid`, bool [n])."""
    n = len(table)
    train = np.ones(n, bool) if split == "train" else np.zeros(n, bool) if split == "valid" else ~valid
    width = len(description.dense) + len(description.sparse)
    missing, reports = np.zeros(width, np.int64), {}
    label = table.column(description.label).to_numpy().astype(np.float32)  # never null: checked when parsed
    columns = {LABEL: pa.array(label)}
    for j, name in enumerate(description.dense):
        values = table.column(name)
        columns[name] = pa.array(transform_dense(values, description.transform(name)))
        missing[j] = values.null_count
    side, counts = {}, {}
    everyone = split == "train"
    for j, name in enumerate(description.sparse):
        k = len(description.dense) + j
        if name in description.multi_hot:
            options = description.multi_hot[name]
            rows, lists, texts = _lists(table.column(name), options)
            columns[name] = pa.array(rows)
            side[name] = (lists.values, lists.codes)
            per_list = np.bincount(rows, minlength=len(lists.lengths))
            missing[k] = int(per_list[lists.empty].sum())
            reports[name] = report_lengths(lists, rows, train, texts, options.separator)
            if train.any():
                weights = per_list if everyone else np.bincount(rows[train], minlength=len(lists.lengths))
                found = lists.counts(weights)
                keep = found > 0
                counts[name] = (lists.values.filter(pa.array(keep)), found[keep])
        else:
            indices, dictionary = _dictionary(table.column(name))
            columns[name] = pa.array(indices)
            side[name] = dictionary
            per_value = np.bincount(indices, minlength=len(dictionary))
            empty = pc.equal(dictionary, "").to_numpy(zero_copy_only=False)
            missing[k] = int(per_value[empty].sum())
            if train.any():
                found = per_value if everyone else np.bincount(indices[train], minlength=len(dictionary))
                keep = (found > 0) & ~empty
                counts[name] = (dictionary.filter(pa.array(keep)), found[keep].astype(np.int64))
    if split == "split":
        columns[VALID] = pa.array(valid)
    label_sum = int(np.count_nonzero(label[train]))
    return EncodedBlock(pa.table(columns), side, counts, missing, reports, label_sum)


def _lists(column: pa.Array | pa.ChunkedArray, options) -> tuple[np.ndarray, Lists, pa.Array | None]:
    """(row → list index int32 [n], the distinct lists, their texts or None for a list column): a text
    column's distinct texts are split once (an unset max_length: as long as the block's longest list)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(column.type) or pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        rows, texts = _dictionary(column)
        return rows, split_lists(texts, options.separator, options.max_length, options.keep), texts
    lists = split_lists(column, options.separator, options.max_length, options.keep)
    return np.arange(len(column), dtype=np.int32), lists, None


def lookup_block(table: pa.Table, side: dict, description: Description, vocab) -> dict:
    """The Parquet columns of a cached block: label, dense, and each sparse column's ids (int32 [n], or
    [n, max_length] for multi-hot) from the dictionaries looked up in `vocab` (`Vocabularies`)."""
    columns = {name: table.column(name).combine_chunks() for name in (LABEL, *description.dense)}
    for name in description.sparse:
        rows = table.column(name).to_numpy()
        encoder = vocab.columns[name]
        if name in description.multi_hot:
            values, codes = side[name]
            options = description.multi_hot[name]  # the block's lists in the settled max_length's slots
            lists = Lists(values, codes, np.zeros(len(codes), np.int64)).resized(options.max_length, options.keep)
            ids = lists.ids(encoder.encode(values))
            columns[name] = np.take(ids, rows, axis=0)  # 10x faster than ids[rows] for [n, max_length]
        else:
            columns[name] = encoder.encode(side[name]).take(rows)
    return columns
