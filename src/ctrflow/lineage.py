"""Is this data a descendant of the data a checkpoint was trained on? (`ctrflow train --init-from`)

A descendant has the same features (names, kinds, dense transforms, max lengths, poolings) and, for
every sparse feature, a vocabulary that starts with the checkpoint's: each old value keeps its id
(what `ctrflow preprocess --vocab-from` makes, day after day). It is proven from the checkpoint's
`schema.json` alone: the sha256 of this data's vocabularies cut to the checkpoint's sizes must be the
checkpoint's `vocab_hash`. When it is not, the first differing id is named from the checkpoint's own
vocabulary, found where the checkpoint was trained (its config's data path) or along this data's
lineage (`schema.json` `parent` paths).
"""

from __future__ import annotations

from pathlib import Path

from ctrflow.errors import UserError
from ctrflow.contract.features import FIRST_ID
from ctrflow.contract.vocab import Vocabularies, vocab_hash
from ctrflow.contract.schema import Schema, feature_differences

MAX_LINEAGE = 1000  # parents followed at most (a loop of parents is a damaged lineage)


def check_descendant(trained: Schema, data: Schema, data_dir: str | Path, where: str,
                     trained_dir: str | Path | None = None) -> None:
    """A one-line UserError (prefixed `where`) unless `data` (at `data_dir`) extends `trained`'s
    vocabularies; `trained_dir`: where the checkpoint's data was (to name a differing value)."""
    diffs = feature_differences(trained.features, data.features, sides=("in the checkpoint", "here"))
    if diffs:
        raise UserError(f"{where}: the checkpoint was trained on other features: " + "; ".join(diffs[:4]))
    smaller = [f"feature {a.name}: {a.cardinality - FIRST_ID} values in the checkpoint's vocabulary, "
               f"{b.cardinality - FIRST_ID} here" for a, b in zip(trained.features.sparse, data.features.sparse)
               if b.cardinality < a.cardinality]
    if smaller:
        raise UserError(f"{where}: this data's vocabulary is smaller than the checkpoint's ({smaller[0]}); "
                        "preprocess it with --vocab-from the checkpoint's data")
    if trained.vocab_hash == data.vocab_hash:
        return
    try:
        vocab = Vocabularies.load(data_dir, data)
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    sizes = {f.name: f.cardinality - FIRST_ID for f in trained.features.sparse}
    prefix_hash = vocab_hash({name: col.values.slice(0, sizes[name]) for name, col in vocab.columns.items()})
    if prefix_hash == trained.vocab_hash:
        return
    old = find_vocabulary(trained.vocab_hash, [trained_dir, *lineage(data)])
    if old is not None:
        for name, col in vocab.columns.items():
            mine, theirs = old.columns[name].values, col.values.slice(0, sizes[name])
            for k, (a, b) in enumerate(zip(mine.to_pylist(), theirs.to_pylist())):
                if a != b:
                    raise UserError(f'{where}: feature {name}: id {k + FIRST_ID} is "{a}" in the checkpoint\'s '
                                    f'vocabulary and "{b}" here; preprocess with --vocab-from the checkpoint\'s data')
    raise UserError(f"{where}: this data's vocabularies do not extend the checkpoint's (their first values hash to "
                    f"{prefix_hash[:12]}, the checkpoint's vocab_hash is {trained.vocab_hash[:12]}); preprocess with "
                    "--vocab-from the checkpoint's data")


def lineage(data: Schema) -> list[str]:
    """The directories of `data`'s ancestors, nearest first (schema.json `parent` paths that still exist)."""
    paths, seen, schema = [], set(), data
    while schema.parent and len(paths) < MAX_LINEAGE:
        path = schema.parent.get("path")
        if not path or path in seen or not (Path(path) / "schema.json").exists():
            break
        seen.add(path)
        paths.append(path)
        schema = Schema.load(path)
    return paths


def find_vocabulary(wanted_hash: str, candidates) -> Vocabularies | None:
    """The vocabularies of the first candidate directory whose schema's `vocab_hash` is `wanted_hash`."""
    for directory in candidates:
        if not directory or not (Path(directory) / "schema.json").exists():
            continue
        try:
            schema = Schema.load(directory)
            if schema.vocab_hash == wanted_hash:
                return Vocabularies.load(directory, schema)
        except UserError:
            continue
    return None
