"""Evaluation throughput: rows/s of scoring a whole split in order, as `ctrflow evaluate` and validation do.

    PYTHONPATH=src python3 benchmarks/loader_throughput.py --rows 16000000 --data zipf --write-only /tmp/d
    PYTHONPATH=src python3 benchmarks/eval_throughput.py --data /tmp/d --split train [--cold]

Streams `DATA/SPLIT` through `ScanLoader` (page-locked windows, one copy per window, batches sliced
on the device) into a freshly initialised model (`--model`, `--embedding-dim`) and keeps logits and
labels (`score_batches`): rows/s in fp32 (as `ctrflow evaluate`) and under bf16 autocast (as
validation in a bf16 training run), with the page cache warm and, with `--cold`, after dropping the
split from it. Then the time of the exact metrics on the host, and a check that AUC and logloss
equal the in-memory path's (the split read whole, scored with `score_logits`) on the first
`--check-rows` rows. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ctrflow.loaders.memory import ParquetDataset
from ctrflow.loaders.scan import ScanLoader
from ctrflow.contract.schema import Schema
from ctrflow.loaders.stream_plan import ParquetIndex
from ctrflow.evaluate import compute_metrics
from ctrflow.evaluate.scoring import score_batches
from ctrflow.models import build_model
from ctrflow.predict import score_logits
from ctrflow.train.validate import valid_metrics

sys.path.insert(0, str(Path(__file__).parent))
from page_cache import cached_fraction, drop_page_cache  # noqa: E402


def timed_scores(model, loader: ScanLoader, device: torch.device, amp) -> tuple[dict, np.ndarray, np.ndarray]:
    """Rows/s of one whole pass (device synchronized at both ends), and its labels and logits."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    labels, logits = score_batches(model, loader.batches(), device, amp)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"rows_per_s": labels.size / seconds, "seconds": seconds, "rows": int(labels.size)}, labels, logits


def check_in_memory(model, args, device: torch.device, loader_rows: int) -> dict:
    """AUC / logloss of the first `--check-rows` rows: streamed vs read whole (today's in-memory path)."""
    index = ParquetIndex(args.data, args.split)
    rows = min(args.check_rows, len(index))
    limited = ScanLoader(index, args.batch_size, device=device, threads=args.threads,
                         limit_batches=rows // args.batch_size)
    labels, logits = score_batches(model, limited.batches(), device)
    whole = ParquetDataset(args.data, args.split)
    n = labels.size
    reference = score_logits(model, whole.dense[:n], whole.sparse[:n], args.batch_size)
    streamed, memory = valid_metrics(labels, logits), valid_metrics(whole.labels[:n], reference)
    return {"rows": n, "split_rows": loader_rows, "auc_stream": streamed["auc"], "auc_memory": memory["auc"],
            "logloss_stream": streamed["logloss"], "logloss_memory": memory["logloss"],
            "labels_equal": bool(np.array_equal(labels, whole.labels[:n])),
            "max_logit_diff": float(np.abs(logits - reference).max()) if n else 0.0}


def main(argv=None) -> dict:
    """Time, check and print."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="valid")
    p.add_argument("--model", default="dlrm")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=262144)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--check-rows", type=int, default=4_000_000)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    schema = Schema.load(args.data)
    model = build_model(args.model, schema, args.embedding_dim).to(device).eval()
    loader = ScanLoader(ParquetIndex(args.data, args.split), args.batch_size, table_sizes=schema.table_sizes(),
                        device=device, threads=args.threads)
    result = {"benchmark": "eval_throughput", "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "rows": len(loader.dataset), "batch": args.batch_size, "model": args.model,
              "embedding_dim": args.embedding_dim, "buffer_gib": loader.buffer_bytes() / 2**30}
    timed_scores(model, loader, device, None)  # warm-up: kernels, allocator, page cache
    result["fp32"], labels, logits = timed_scores(model, loader, device, None)
    if device.type == "cuda":
        result["bf16"], _, _ = timed_scores(model, loader, device, torch.bfloat16)
    if args.cold:
        root = Path(args.data) / args.split
        result["drop"] = drop_page_cache(root.parent, root.name)
        result["cached_after_drop"] = cached_fraction(root.parent, root.name)
        result["fp32_cold"], _, _ = timed_scores(model, loader, device, None)
    start = time.perf_counter()
    metrics = compute_metrics(labels, logits)
    result["metrics"] = {"seconds": time.perf_counter() - start, "auc": metrics["auc"], "rows": metrics["rows"]}
    result["rows_accounted"] = metrics["rows"] == len(loader.dataset)
    result["check"] = check_in_memory(model, args, device, len(loader.dataset))
    print(json.dumps(result), flush=True)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    """The rates, metric time and check as a markdown table (stderr)."""
    lines = ["| eval pass | rows/s | seconds | rows |", "|---|---|---|---|"]
    for key in ("fp32", "bf16", "fp32_cold"):
        if key in result:
            r = result[key]
            lines.append(f"| {key} | {r['rows_per_s'] / 1e6:.2f} M | {r['seconds']:.2f} | {r['rows']:,} |")
    m, c = result["metrics"], result["check"]
    lines.append(f"| exact metrics (host) | {m['rows'] / m['seconds'] / 1e6:.2f} M | {m['seconds']:.2f} | "
                 f"{m['rows']:,} |")
    lines.append(f"\ncheck on {c['rows']:,} rows: auc stream {c['auc_stream']:.12f} memory {c['auc_memory']:.12f}; "
                 f"logloss {c['logloss_stream']:.12f} / {c['logloss_memory']:.12f}; labels equal "
                 f"{c['labels_equal']}; max |logit diff| {c['max_logit_diff']:.3g}; rows accounted "
                 f"{result['rows_accounted']}; cached after drop {result.get('cached_after_drop')}")
    print("\n".join(lines), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
