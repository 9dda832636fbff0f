"""Preprocess speed vs pyarrow merely parsing the same file; prints one JSON line.

    python benchmarks/preprocess.py [--rows 1000000] [--workers N] [--hugectr-script PATH]
                                    [--engine cpu|gpu] [--device cuda|cpu]
    python benchmarks/preprocess.py --format csv [--rows 5000000] [--quoted] [--repeats 3] [--ceiling]

`--format csv`: a generic table (MovieLens-like: skewed user and movie ids, a genre list of 0-4
values, a year, a price with missing values, an unused timestamp, a 0/1 label; `--quoted`: every text
value quoted, as Arrow's CSV writer does) and its dataset description. Then, alternating, whole
processes both: `python -c "pyarrow.csv.read_csv(FILE)"` (all threads, type inference) and
`python -m ctrflow preprocess --dataset DESCRIPTION --train FILE --out DIR --tracking-uri none`; the best
wall time of `--repeats` each gives the ratio (imports, process start and exit included on both sides;
ctrflow's modules are compiled to bytecode first, as an installed package's are). `--ceiling` alternates a
third process, `table_ceiling.py`: the same file only parsed and written as Parquet parts, the floor of
any two-pass preprocessor built on pyarrow.

Synthetic Criteo-format rows (`ctrflow.synth.criteo`; a plain numpy generator where that is absent)
are written once to a work directory. Then, in the same run: pyarrow.csv.read_csv of the file
(all threads, type inference: the "merely parses" rate), and `ctrflow preprocess` end to end
(fit + transform, raw TSV → Parquet, the library call after imports), best of `--repeats` each; then
one more preprocess run while the memory (PSS) of this process and its workers is sampled for the
peak (the sampler costs CPU: timings are taken without it). CPU seconds are reported too: on a shared
machine they say more than wall time. `--hugectr-script` runs HugeCTR's pandas preprocessing script
(never vendored) on the same file for the speed-up figure.
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from ctrflow.ingest.output import file_digest
from ctrflow.ingest.run import preprocess
from ctrflow.contract.criteo import DENSE, RAW_COLUMNS, SPARSE


def plain_sha256(path: Path) -> str:
    """One sequential sha256 stream over the file (what schema.json recorded before the tree digest)."""
    digest, buffer = hashlib.sha256(), bytearray(1 << 22)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(memoryview(buffer)[:n])
    return digest.hexdigest()


def write_rows(path: Path, rows: int, seed: int) -> str:
    """A raw TSV of `rows` rows; returns which generator wrote it."""
    try:
        from ctrflow.synth.criteo import synthesize

        synthesize(path.parent / "synth", rows=rows, days=1, seed=seed)
        os.replace(path.parent / "synth" / "day_0.tsv", path)
        return "ctrflow.synth.criteo"
    except ImportError:
        pass
    rng = np.random.default_rng(seed)
    columns = {"label": pa.array((rng.random(rows) < 0.25).astype(np.int64))}
    for name in DENSE:
        values = np.floor(rng.pareto(1.0, rows) * 3).astype(np.int64)
        columns[name] = pa.array(values, mask=rng.random(rows) < 0.2)
    for j, name in enumerate(SPARSE):
        ranks = np.minimum(rng.zipf(1.2, rows), 10 ** (2 + j % 6)).astype(np.uint64)
        hashed = (ranks * np.uint64(2654435761) + np.uint64(j)) & np.uint64(0xFFFFFFFF)
        text = np.char.mod("%08x", hashed)
        text[rng.random(rows) < 0.1] = ""
        columns[name] = pa.array(text)
    options = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    pcsv.write_csv(pa.table(columns), path, options)
    return "numpy"


def time_pyarrow_parse(path: Path) -> float:
    """Seconds for pyarrow.csv.read_csv of the whole file (defaults: all threads, type inference)."""
    start = time.perf_counter()
    pcsv.read_csv(path, read_options=pcsv.ReadOptions(column_names=list(RAW_COLUMNS)),
                  parse_options=pcsv.ParseOptions(delimiter="\t"))
    return time.perf_counter() - start


def tree_memory(pid: int) -> int:
    """Bytes of memory of a process and all its descendants: the sum of their PSS (shared pages, e.g.
    those a forked worker inherits, counted once), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(fn, memory: bool = True) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak memory (PSS bytes) of this process and its workers) of fn().
    `memory=False`: no sampling (peak 0). The sampler reads every process's smaps_rollup, which walks
    its page tables: ~12 ms of CPU a sample, ~0.18 CPU-s per 1 M-row preprocess run on 2 cores, so
    timings are taken without it and the peak in a run of its own."""
    peak = 0
    done = threading.Event()

    def sample():  # every 50 ms until fn returns
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_memory(os.getpid()))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    if memory:
        sampler.start()
    cpu, start = cpu_seconds(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    done.set()
    if memory:
        sampler.join()
    return wall, cpu, peak


def run_hugectr(script: str, raw: Path, work: Path) -> float:
    """Seconds for HugeCTR's pandas preprocessing script (tools/criteo_script/preprocess.py, which
    needs pandas, scikit-learn and six) on the same file."""
    dst = work / "hugectr_out.txt"
    dst.unlink(missing_ok=True)  # the script refuses to overwrite
    cmd = [sys.executable, script, "--src_csv_path", str(raw), "--dst_csv_path", str(dst),
           "--normalize_dense", "1", "--feature_cross", "0"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def gpu_name(args) -> str | None:
    """The GPU the gpu engine ran on (torch imported only for that engine)."""
    if args.engine != "gpu" or not args.device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(args.device))


GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
DESCRIPTION = """\
format: csv
label: liked
dense: [year, price]
categorical: [userId, movieId]
multi_hot:
  genres: {separator: "|", max_length: 4, pooling: mean}
freq_threshold: {default: 6, userId: 2}
"""


def write_table(path: Path, rows: int, seed: int, quoted: bool) -> None:
    """A MovieLens-like CSV of `rows` rows, written block by block (bounded memory)."""
    rng = np.random.default_rng(seed)
    genre_rng = np.random.default_rng(seed + 1)
    movie_genres = np.array(["|".join(GENRES[g] for g in genre_rng.choice(len(GENRES), k, replace=False))
                             for k in genre_rng.integers(0, 5, 50_001)], dtype=object)
    options = pcsv.WriteOptions(quoting_style="needed" if quoted else "none")
    schema = None
    with open(path, "wb") as sink:
        for start in range(0, rows, 1 << 20):
            n = min(1 << 20, rows - start)
            movies = np.minimum(rng.zipf(1.2, n), 50_000)
            price = np.char.mod("%.2f", np.round(rng.gamma(2.0, 5.0, n), 2)).astype(object)
            price[rng.random(n) < 0.05] = ""
            table = pa.table({"userId": np.minimum(rng.zipf(1.3, n), 200_000), "movieId": movies,
                              "genres": pa.array(movie_genres[movies], pa.string()),
                              "year": rng.integers(1950, 2024, n), "price": pa.array(price, pa.string()),
                              "rating_ts": rng.integers(10 ** 9, 2 * 10 ** 9, n),
                              "liked": (rng.random(n) < 0.3).astype(np.int64)})
            schema = schema or table.schema
            block = options if start == 0 else pcsv.WriteOptions(include_header=False,
                                                                  quoting_style=options.quoting_style)
            pcsv.write_csv(table.cast(schema), sink, block)


def run_process(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of one whole process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_table(args) -> dict:
    """The generic CSV against pyarrow's parse, both whole processes, alternating."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctrflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    raw = work / f"movies_{args.rows}{'_quoted' if args.quoted else ''}.csv"
    if not raw.exists():
        write_table(raw, args.rows, args.seed, args.quoted)
    description = work / "movies.yaml"
    description.write_text(DESCRIPTION)
    src = Path(__file__).resolve().parents[1] / "src"
    # bytecode as an installed package has it: without it every process compiles ctrflow's modules
    # (~0.2 CPU-s; PYTHONDONTWRITEBYTECODE keeps Python from caching them itself)
    compileall.compile_dir(src / "ctrflow", quiet=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    load_before = os.getloadavg()[0]
    parse = [sys.executable, "-c", f"import pyarrow.csv as c; c.read_csv({str(raw)!r})"]
    command = [sys.executable, "-m", "ctrflow", "preprocess", "--dataset", str(description), "--train", str(raw),
               "--out", str(work / "out"), "--tracking-uri", "none"]
    command += ["--workers", str(args.workers)] if args.workers else []
    ceiling = [sys.executable, str(Path(__file__).with_name("table_ceiling.py")), str(raw), str(work / "ceiling"),
               "--workers", str(args.workers or os.cpu_count())]
    parses, runs, ceilings = [], [], []
    for _ in range(args.repeats):
        parses.append(run_process(parse, env))
        runs.append(run_process(command, env))
        if args.ceiling:
            ceilings.append(run_process(ceiling, env))
    stats = json.loads((work / "out" / "stats.json").read_text())
    (parse_wall, parse_cpu), (wall, cpu) = min(parses), min(runs)
    result = {
        "benchmark": "preprocess", "format": "csv", "quoted": args.quoted, "rows": args.rows,
        "input_bytes": raw.stat().st_size, "pyarrow_parse_process_seconds": round(parse_wall, 3),
        "preprocess_process_seconds": round(wall, 3), "ratio_vs_pyarrow_parse": round(parse_wall / wall, 3),
        "pyarrow_parse_cpu_seconds": round(parse_cpu, 3), "preprocess_cpu_seconds": round(cpu, 3),
        "all_walls": {"pyarrow": [round(w, 3) for w, _ in parses], "preprocess": [round(w, 3) for w, _ in runs]},
        "passes": stats["passes"], "workers": stats["workers"], "chunk_rows": stats["chunk_rows"],
        "cardinalities": {k: v["cardinality"] for k, v in stats["columns"].items() if "cardinality" in v},
        "cpus": os.cpu_count(), "machine": platform.node(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before and after
    }
    if ceilings:  # parse + write alone (`table_ceiling.py`), in the same alternation
        result["all_walls"]["ceiling"] = [round(w, 3) for w, _ in ceilings]
        result["ceiling_process_seconds"] = round(min(ceilings)[0], 3)
        result["ceiling_cpu_seconds"] = round(min(ceilings)[1], 3)
        result["ceiling_ratio_vs_pyarrow_parse"] = round(parse_wall / min(ceilings)[0], 3)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse flags, write the input once, time both, print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="criteo", choices=["criteo", "csv"],
                        help="criteo: the raw Criteo TSV (library calls); csv: a described table (whole processes)")
    parser.add_argument("--quoted", action="store_true", help="csv: quote every text value")
    parser.add_argument("--ceiling", action="store_true",
                        help="csv: also time table_ceiling.py (parse + Parquet write alone), alternated")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=None, help="preprocess workers (default: all cores)")
    parser.add_argument("--chunk-rows", type=int, default=None, help="preprocess --chunk-rows (default: its own)")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings of each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the input and outputs here")
    parser.add_argument("--engine", default="cpu", help="preprocess --engine (cpu, gpu)")
    parser.add_argument("--device", default="cuda", help="torch device of --engine gpu")
    parser.add_argument("--hugectr-script", default=None,
                        help="HugeCTR's tools/criteo_script/preprocess.py, run on the same file")
    args = parser.parse_args(argv)
    if args.format == "csv":
        print(json.dumps(bench_table(args)))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctrflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    raw = work / f"raw_{args.rows}.tsv"
    generator = "existing file"
    if not raw.exists():
        generator = write_rows(raw, args.rows, args.seed)
    out = work / "out"
    runs = []

    def run_preprocess():
        preprocess([str(raw)], out=out, workers=args.workers, progress=False, engine=args.engine, device=args.device,
                   **({"chunk_rows": args.chunk_rows} if args.chunk_rows else {}))

    for _ in range(args.repeats):  # timings: no memory sampler beside them
        wall, cpu, _ = measure(run_preprocess, memory=False)
        runs.append((wall, cpu, json.loads((out / "stats.json").read_text())))
    peak = measure(run_preprocess)[2]  # one more run for the peak memory
    seconds, cpu, stats = min(runs, key=lambda r: r[0])
    parse = min(measure(lambda: time_pyarrow_parse(raw), memory=False) for _ in range(args.repeats))
    started = time.perf_counter()
    file_digest(raw)  # schema.json's file digest computed apart (in preprocess the fit workers checksum the pieces)
    digest_seconds = time.perf_counter() - started
    started = time.perf_counter()
    plain_sha256(raw)  # the former digest, one sequential stream: for comparison only
    sha256_seconds = time.perf_counter() - started
    result = {
        "benchmark": "preprocess", "rows": args.rows, "input_bytes": raw.stat().st_size, "generator": generator,
        "pyarrow_parse_rows_per_s": round(args.rows / parse[0]), "preprocess_rows_per_s": round(args.rows / seconds),
        "ratio_vs_pyarrow_parse": round(parse[0] / seconds, 3),
        "preprocess_seconds": round(seconds, 3), "pyarrow_parse_seconds": round(parse[0], 3),
        "preprocess_cpu_seconds": round(cpu, 3), "pyarrow_parse_cpu_seconds": round(parse[1], 3),
        "passes": stats["passes"], "input_digest_seconds": round(digest_seconds, 3),
        "input_plain_sha256_seconds": round(sha256_seconds, 3),
        "peak_pss_mb": round(peak / 2 ** 20, 1),
        "distinct_values": sum(c.get("distinct_train", 0) for c in stats["columns"].values()),
        "engine": args.engine, "device": args.device if args.engine == "gpu" else None,
        "gpu": gpu_name(args),
        "workers": stats["workers"], "chunk_rows": stats["chunk_rows"], "cpus": os.cpu_count(),
        "machine": platform.node(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if args.hugectr_script:
        hugectr_s = run_hugectr(args.hugectr_script, raw, work)
        result["hugectr_rows_per_s"] = round(args.rows / hugectr_s)
        result["speedup_vs_hugectr"] = round(hugectr_s / seconds, 2)
    print(json.dumps(result))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
