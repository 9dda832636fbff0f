"""Raw fields → model inputs, for any dataset: the one implementation predict and serving share with
preprocessing (the same number parsing, dense transform, vocabulary lookup and list splitting).

`transform_raw(columns, schema, vocab)` takes the raw text of the description's raw columns, as a
client sends them or a file holds them:
- dense: the number as text ("" or None: missing → 0), then the feature's transform;
- categorical: the value as text ("" or None: missing, id 0);
- multi-hot: the separated text ("Action|Comedy"; "" or None: empty, all padding), a longer list cut as
  the description's `keep` says (its first or last max_length values);
and gives exactly the floats and ids preprocessing wrote. A bad value raises `UserError` naming the
field and the row.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.description import Description, MultiHot
from ctrflow.errors import UserError
from ctrflow.contract.lists import split_lists
from ctrflow.contract.numbers import not_finite, parse_numbers
from ctrflow.contract.numbers import transform_dense as _transform_column
from ctrflow.contract.vocab import Vocabularies


def description_of(schema) -> Description:
    """The dataset description a schema was made from: `schema.dataset`, or for a schema written before
    descriptions existed (the Criteo TSV), one read off its features (dense values integers)."""
    if schema.dataset:
        return Description.from_dict(schema.dataset, f"{schema.dataset.get('name', 'dataset')} (schema.json)")
    features = schema.features
    return Description(format="tsv", label="label", dense=tuple(f.name for f in features.dense),
                       categorical=tuple(f.name for f in features.sparse), header=False, delimiter="\t",
                       quote=None, columns=("label", *features.names()), default_threshold=schema.freq_threshold,
                       dense_type="integer", name="criteo", source="schema.json")


def transform_raw(columns: Mapping[str, Sequence[str | None]], schema, vocab: Vocabularies | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Raw text of every raw column (`Description.raw_columns`: dense, categorical, multi-hot; lists,
    numpy arrays of str or bytes, or Arrow string arrays, one value per row) → (dense float32
    [N, num_dense], sparse int32 [N, slots]), each sparse feature in its `Feature.width` slots in
    feature order. `schema`: the processed data's `Schema`; `vocab`: its `Vocabularies` (`load_vocabularies`).
    Also `transform_raw(columns, vocab)` with vocabularies loaded from a directory holding schema.json.
    A missing field, fields of unequal length or a bad value raise `UserError` naming the field (and row)."""
    if vocab is None:  # transform_raw(columns, vocab): the schema the vocabularies were loaded with
        vocab, schema = schema, getattr(schema, "schema", None)
        if schema is None:
            raise UserError("transform_raw needs the schema (vocabularies loaded without one)")
    features, description = schema.features, description_of(schema)
    names = features.names()
    absent = [c for c in names if c not in columns]
    if absent:
        raise UserError(f"missing input field(s): {', '.join(absent)}")
    lengths = {c: len(columns[c]) for c in names}
    n = lengths[names[0]] if names else 0
    uneven = [c for c, m in lengths.items() if m != n]
    if uneven:
        raise UserError(f"field {uneven[0]} has {lengths[uneven[0]]} rows, {names[0]} has {n}")
    dense = np.empty((n, features.num_dense), dtype=np.float32)
    integer = description.dense_type == "integer"
    for j, feature in enumerate(features.dense):
        strings = _strings(columns[feature.name], feature.name)
        values, bad = parse_numbers(strings, integer)
        if bad:
            what = "an integer" if integer else "a number"
            raise UserError(f"field {feature.name}, row {bad[0]}: not {what}: {strings[bad[0]].as_py()!r}")
        infinite = not_finite(values)
        if len(infinite):
            i = int(infinite[0])
            raise UserError(f"field {feature.name}, row {i}: not a finite number: {strings[i].as_py()!r}")
        dense[:, j] = _transform_column(values, feature.transform)
    sparse = np.empty((n, features.slots), dtype=np.int32)
    for feature, (start, stop) in zip(features.sparse, features.slot_spans()):
        strings = _strings(columns[feature.name], feature.name)
        if feature.kind == "multi_hot":
            options = description.multi_hot.get(feature.name) or MultiHot()
            lists = split_lists(strings, options.separator, feature.max_length, options.keep)
            sparse[:, start:stop] = lists.ids(vocab.encode(feature.name, lists.values))
        else:
            sparse[:, start] = vocab.encode(feature.name, strings)
    return dense, sparse


def transform_dense(columns: Sequence[pa.Array], transform: str = "log1p") -> np.ndarray:
    """Dense columns (float64 or int64, null = missing) → float32 [n, len(columns)]: missing → 0, then
    `transform` (log1p of max(x, 0), or none), computed in float64 and rounded once."""
    n = len(columns[0]) if columns else 0
    out = np.empty((n, len(columns)), dtype=np.float32)
    for j, column in enumerate(columns):
        out[:, j] = _transform_column(column, transform)
    return out


def _strings(values: Sequence[str] | pa.Array, name: str) -> pa.Array:
    """Raw values as a string array, None → "" (missing); bytes are decoded as UTF-8."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        if pa.types.is_dictionary(array.type):
            array = array.cast(array.type.value_type)
    else:
        items = values.tolist() if isinstance(values, np.ndarray) else list(values)
        items = [v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else v for v in items]
        try:
            array = pa.array(items, pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise UserError(f"field {name}: values must be strings ({err})") from None
    return pc.fill_null(array.cast(pa.string()), "")
