"""Latency and throughput of the exported ensemble through a real `tritonserver` on 127.0.0.1.

    python benchmarks/serve_latency.py [--repo REPO --rows FILE] [--dataset criteo|movielens-like]
                                       [--batches 1,64,1024]

Without `--repo` it builds one first (synth --dataset -> preprocess -> train a few steps -> export
--backend python, in a temp dir). One client sends raw rows (BYTES per raw column of the schema, the
text its files hold, as a caller would) over HTTP, one request at a time, for each batch size: a
bounded number of requests within a time budget. `--rows` is a raw file in the format of the
dataset the repository was exported for. Prints ONE JSON line: p50/p99 latency (ms) and rows/s per
batch size. Needs the serving venv (`scripts/setup_triton.sh`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ctrflow.serve.tritonserver import TritonServer, find_serving_venv

DAYS = {"criteo": ("day_0.tsv", "day_1.tsv", "criteo"), "movielens-like": ("day_0.csv", "day_1.csv", "movielens.yaml")}


def build_repository(workdir: Path, rows: int, dataset: str) -> tuple[Path, Path]:
    """A small python-backend repository and the raw day file to draw request rows from."""
    from ctrflow.cli import main

    os.environ["MLFLOW_TRACKING_URI"] = "none"
    train, valid, described = DAYS[dataset]
    raw = workdir / "raw"
    steps = [
        ["synth", "--dataset", dataset, "--rows", str(rows), "--days", "2", "--seed", "11", "--out", str(raw)],
        ["preprocess", "--dataset", described if described == "criteo" else str(raw / described),
         "--train", str(raw / train), "--valid", str(raw / valid), "--out", str(workdir / "data")],
        ["train", "--data", str(workdir / "data"), "--model", "dlrm", "--out", str(workdir / "ckpt"),
         "--max-steps", "20", "--batch-size", "256"],
        ["export", "--checkpoint", str(workdir / "ckpt"), "--data", str(workdir / "data"),
         "--out", str(workdir / "repo"), "--name", "ctr", "--backend", "python"],
    ]
    for argv in steps:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one result line only
            code = main(argv)
        if code != 0:
            raise SystemExit(f"ctrflow {argv[0]} failed")
    return workdir / "repo", raw / valid


def read_rows(repo: Path, name: str, path: Path, count: int) -> dict[str, list[str]]:
    """The first `count` rows of a raw file, as the text of each raw column the ensemble takes."""
    from ctrflow.contract.formats.raw import read_raw_rows
    from ctrflow.contract.transform import description_of
    from ctrflow.contract.schema import Schema

    schema = Schema.load(repo / f"{name}_preprocess" / "1")  # the contract the repository was exported with
    rows: dict[str, list[str]] = {}
    for block in read_raw_rows(path, description_of(schema)):
        for column, values in block.columns.items():
            rows.setdefault(column, []).extend(values.to_pylist())
        if len(next(iter(rows.values()))) >= count:
            break
    return {column: values[:count] for column, values in rows.items()}


def request_inputs(rows: dict[str, list[str]], picked: list[int]):
    """One BYTES [B, 1] input per raw column, rows `picked`."""
    import tritonclient.http as httpclient

    inputs = []
    for name, column in rows.items():
        values = np.array([[column[i].encode()] for i in picked], dtype=object)
        tensor = httpclient.InferInput(name, list(values.shape), "BYTES")
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    return inputs


def compute_ns(client) -> dict[str, tuple[int, int]]:
    """Per model: (total compute ns, executions) so far, from Triton's statistics endpoint."""
    stats = client.get_inference_statistics()["model_stats"]
    return {m["name"]: (int(m["inference_stats"]["compute_infer"]["ns"]), int(m["execution_count"]))
            for m in stats}


def measure(client, name: str, rows: dict[str, list[str]], batch: int, requests: int, budget_s: float,
            warmup: int) -> dict:
    """Send up to `requests` requests of `batch` rows (stopping after `budget_s`); latency stats."""
    import tritonclient.http as httpclient

    count = len(next(iter(rows.values())))
    inputs = request_inputs(rows, [i % count for i in range(batch)])
    outputs = [httpclient.InferRequestedOutput("probability")]
    for _ in range(warmup):
        client.infer(name, inputs, outputs=outputs)
    latencies = []
    before = compute_ns(client)
    start = time.perf_counter()
    while len(latencies) < requests and time.perf_counter() - start < budget_s:
        sent = time.perf_counter()
        reply = client.infer(name, inputs, outputs=outputs)
        latencies.append(time.perf_counter() - sent)
        assert reply.as_numpy("probability").shape[0] == batch
    elapsed = time.perf_counter() - start
    after = compute_ns(client)
    ms = np.array(latencies) * 1e3
    # where a request's time goes inside the server: mean compute per execution of each step
    steps = {model: round((after[model][0] - before[model][0]) / max(1, after[model][1] - before[model][1]) / 1e6, 3)
             for model in after if model != name and model in before}
    return {"batch": batch, "requests": len(latencies), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "rows_per_s": round(batch * len(latencies) / elapsed, 1),
            "compute_ms": steps}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="an exported repository (default: build one)")
    parser.add_argument("--rows", type=Path, help="raw rows to send, in the dataset's format (with --repo)")
    parser.add_argument("--dataset", default="criteo", choices=sorted(DAYS),
                        help="the synthetic dataset of the repository built without --repo")
    parser.add_argument("--name", default="ctr", help="ensemble name in the repository")
    parser.add_argument("--batches", default="1,64,1024", help="comma-separated batch sizes")
    parser.add_argument("--requests", type=int, default=200, help="at most this many requests per batch size")
    parser.add_argument("--budget", type=float, default=20.0, help="at most this many seconds per batch size")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server's models")
    parser.add_argument("--venv", type=Path, default=None, help="serving venv (default: .venv-triton)")
    args = parser.parse_args(argv)
    venv = args.venv or find_serving_venv()
    if venv is None:
        raise SystemExit("serving venv absent: run scripts/setup_triton.sh")
    import tritonclient.http as httpclient

    with tempfile.TemporaryDirectory(prefix="ctrflow-serve-bench-") as tmp:
        tmp = Path(tmp)
        repo, raw = (args.repo, args.rows) if args.repo else build_repository(tmp, rows=5000, dataset=args.dataset)
        rows = read_rows(repo, args.name, raw, 4096)
        with TritonServer(repo, venv, tmp / "server", threads=args.threads) as server:
            client = httpclient.InferenceServerClient(server.url, connection_timeout=60, network_timeout=120)
            try:
                results = [measure(client, args.name, rows, int(b), args.requests, args.budget, args.warmup)
                           for b in args.batches.split(",")]
            finally:
                client.close()
    print(json.dumps({"benchmark": "serve_latency", "server": "tritonserver 2.51 (nvidia-pytriton 0.7.0), python backend, CPU",
                      "transport": "HTTP on 127.0.0.1, 1 client, 1 request in flight", "cpu_count": os.cpu_count(),
                      "machine": platform.machine(), "server_threads": args.threads,
                      "dataset": args.dataset if not args.repo else str(args.repo), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
