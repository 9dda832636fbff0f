#!/usr/bin/env bash
# One H200, from the repo root: the GPU tests named in TESTS (none by default), then benchmarks/dlrmv2.py at
# the MLPerf DLRMv2 shape with each path's per-kernel profile, and a short table last. PATHS picks the paths
# (default tables,fast:fp8,fast,naive), QUALITY the AUC comparison's steps (0: none), TRAIN_STEPS (if set)
# the batches of a `ctrflow train --config mlperf-dlrmv2` run on drawn data; results land in $OUT
# (dlrmv2.json, log.txt, profiles.tgz, train*). E.g.  PATHS=fast:fp8,naive QUALITY=100 bash benchmarks/gpu_dlrmv2.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT/raw"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_LIMIT:-150}" python3 -m pytest -q $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12
fi
timeout "${BENCH_LIMIT:-420}" python3 benchmarks/dlrmv2.py --paths "${PATHS:-tables,fast:fp8,fast,naive}" \
  --quality-steps "${QUALITY:-0}" --profile "$OUT/raw" ${BENCH_ARGS:-} 2>> "$OUT/log.txt" > "$OUT/dlrmv2.json"
(cd "$OUT/raw" && tar czf ../profiles.tgz .) && rm -rf "$OUT/raw"
if [ -n "${TRAIN_STEPS:-}" ]; then
  # `ctrflow train --config mlperf-dlrmv2` on drawn data of the full shape, through its own loader; the
  # run's last checkpoint (97 GiB of tables) does not fit this disk: the time limit ends it, after its records.
  # Give it room: 140 s ended one run before its first step (probably the tables' draw on the host)
  python3 benchmarks/dlrmv2_data.py --out /tmp/dlrmv2-data --train-steps "$TRAIN_STEPS"
  timeout "${TRAIN_LIMIT:-360}" python3 -m ctrflow train --config mlperf-dlrmv2 --data /tmp/dlrmv2-data \
    --out /tmp/dlrmv2-ckpt --log-every 10 --tracking-uri none ${TRAIN_ARGS:-} > "$OUT/train.txt" 2>&1
  grep -E "loader|precision|cuda_graphs|compile" "$OUT/train.txt" | head -8
  cp /tmp/dlrmv2-ckpt/metrics.jsonl "$OUT/train_metrics.jsonl" && cat "$OUT/train_metrics.jsonl"
fi
tail -4 "$OUT/log.txt"
python3 - "$OUT/log.txt" <<'PY'
import json, sys
print(f"{'path':<16}{'ms/step':>9}{'M/s':>7}{'spread':>8}{'kernels ms':>11}{'peak GiB':>9}")
for line in open(sys.argv[1]):
    if not line.startswith("{") or "seconds" not in line:
        continue
    (name, r), = [(k, v) for k, v in json.loads(line).items() if k != "seconds"]
    print(f"{name:<16}{r['ms_per_step']:>9.2f}{r['samples_per_s'] / 1e6:>7.3f}{r['spread']:>8.3f}"
          f"{r.get('gpu_ms_per_step', 0):>11.2f}{r.get('peak_memory_gib', 0):>9.1f}")
PY
