"""The ceiling of a two-pass preprocessor built on pyarrow, for `preprocess.py --format csv --ceiling`.

    python benchmarks/table_ceiling.py FILE OUT_DIR [--workers 2]

A whole process that does only what any such preprocessor must: cut the MovieLens-like CSV that
`preprocess.py` writes into 8 blocks of whole rows, and on `--workers` forked processes parse each block
with the described types (pyarrow's reader, one thread: label and dense as float64, the categorical and
multi-hot columns dictionary-encoded) and write its Parquet part in ctrflow's layout (label and dense
float32, ids int32, the 4-wide multi-hot list). No checks, counting, vocabulary, lookup, digest or
accounting: the ids are the blocks' dictionary indices and the list column is zeros. What ctrflow adds
to this is the price of a correct output.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

BLOCKS = 8
_DICTIONARY = pa.dictionary(pa.int32(), pa.binary())
TYPES = {"liked": pa.float64(), "year": pa.float64(), "price": pa.float64(),
         "userId": _DICTIONARY, "movieId": _DICTIONARY, "genres": _DICTIONARY}
_LIST = pa.list_(pa.field("element", pa.int32(), nullable=False), 4)
SCHEMA = pa.schema([pa.field("label", pa.float32(), False), pa.field("year", pa.float32(), False),
                    pa.field("price", pa.float32(), False), pa.field("userId", pa.int32(), False),
                    pa.field("movieId", pa.int32(), False), pa.field("genres", _LIST, False)])


def cut_blocks(path: str) -> tuple[list[str], list[int]]:
    """(column names, block boundaries): the header, then `BLOCKS` blocks of whole rows."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.readline()
        cuts = [f.tell()]
        for k in range(1, BLOCKS):
            f.seek(cuts[0] + k * (size - cuts[0]) // BLOCKS)
            f.readline()
            cuts.append(f.tell())
    return [name.strip('"') for name in header.decode().rstrip("\r\n").split(",")], cuts + [size]


def write_block(path: str, columns: list[str], start: int, end: int, part: str) -> None:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    table = pcsv.read_csv(
        pa.BufferReader(data),
        read_options=pcsv.ReadOptions(column_names=columns, use_threads=False, block_size=len(data) + 1),
        convert_options=pcsv.ConvertOptions(include_columns=list(TYPES), column_types=TYPES, null_values=[""],
                                            strings_can_be_null=False))

    def dense(name: str) -> pa.Array:
        return pa.array(pc.fill_null(table.column(name), 0).to_numpy().astype(np.float32))

    lists = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(len(table) * 4, np.int32)), type=_LIST)
    arrays = [dense("liked"), dense("year"), dense("price"), table.column("userId").chunk(0).indices,
              table.column("movieId").chunk(0).indices, lists]
    pq.write_table(pa.Table.from_arrays(arrays, schema=SCHEMA), part, compression="none", use_dictionary=False,
                   write_statistics=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    columns, cuts = cut_blocks(args.file)
    children = []
    for worker in range(args.workers):
        pid = os.fork()
        if pid == 0:
            for k in range(worker, BLOCKS, args.workers):
                write_block(args.file, columns, cuts[k], cuts[k + 1], os.path.join(args.out, f"part-{k:05d}.parquet"))
            os._exit(0)
        children.append(pid)
    failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
