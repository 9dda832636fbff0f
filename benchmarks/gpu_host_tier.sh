#!/usr/bin/env bash
# One H200 (the one-hot dim-256 shape needs more host memory: 256 GiB or more), from the repo root: the
# host tier's GPU tests, then benchmarks/host_tier.py's whole training step at the DLRMv2 shape (fused path,
# 32 GiB budget, dense part in fp8: all-on-GPU against cached), then the one-hot dim-256 shape where the host
# memory holds its 179 GiB (cached side only, dense part in bf16), then, where two GPUs are, that shape's
# two-GPU all-on-GPU baseline (benchmarks/sharded_scale.py), then a short table. Results in $OUT (tests.txt,
# dlrmv2.json, onehot256.json, onehot256_x2.json, log.txt). Knobs: TEST_LIMIT, BENCH_LIMIT (seconds),
# BENCH_ARGS (e.g. "--row-cap 4000000 --budget-gib 4"), DENSE (fp8 | bf16 | none: the tables' step alone),
# PLAIN=1 adds the plain path's tables' step at the DLRMv2 shape, SKIP_TESTS=1.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
free -g | head -2
run() {  # run NAME LIMIT CMD...: the command under a time limit, its stdout in $OUT/NAME, a line if it failed
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name" 2>> "$OUT/log.txt"
  local rc=$?
  [ $rc -eq 0 ] || echo "FAILED: $name (exit $rc$([ $rc -eq 124 ] && echo ': time limit'); see $OUT/log.txt)"
}
if [ -z "${SKIP_TESTS:-}" ]; then
  run tests.txt "${TEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_host_tier_gpu.py
  tail -15 "$OUT/tests.txt"
fi
# shellcheck disable=SC2086
run dlrmv2.json "${BENCH_LIMIT:-420}" python3 benchmarks/host_tier.py --dense "${DENSE:-fp8}" ${BENCH_ARGS:-}
if [ -n "${PLAIN:-}" ]; then
  # shellcheck disable=SC2086
  run dlrmv2_plain.json "${BENCH_LIMIT:-420}" python3 benchmarks/host_tier.py --path plain ${BENCH_ARGS:-}
fi
host_gib=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
if [ "$host_gib" -ge 230 ]; then  # 179 GiB of tables and state, pinned, and room beside them
  # shellcheck disable=SC2086
  run onehot256.json "${BENCH_LIMIT:-420}" python3 benchmarks/host_tier.py --shape onehot-dim256 \
    --dense "$([ "${DENSE:-fp8}" = none ] && echo none || echo bf16)" ${BENCH_ARGS:-}
else
  echo "onehot-dim256 skipped: $host_gib GiB of host memory, its tables take 179 GiB (run it on the 2-GPU machine)"
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ "${DENSE:-fp8}" != none ]; then  # per-GPU rate to compare with
  CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 run onehot256_x2.json "${BENCH_LIMIT:-420}" python3 -m torch.distributed.run \
    --standalone --nproc-per-node 2 benchmarks/sharded_scale.py --dim 256 --graph --optimizer adagrad --precision bf16
fi
tail -5 "$OUT/log.txt" 2>/dev/null
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<20}{'device M/s':>11}{'cached M/s':>11}{'ratio':>7}{'hit rate':>9}{'GB in/out':>11}{'host GiB':>9}"
      f"{'GPU GiB':>9}")
for name in ("dlrmv2.json", "dlrmv2_plain.json", "onehot256.json"):
    path = pathlib.Path(sys.argv[1]) / name
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        continue
    r = json.loads(lines[-1])
    dev, peak = r["device_samples_per_s"], r["gpu_peak_gib"]["cached"] or 0
    moved = r["gb_per_step"] or {"read": 0, "written": 0}
    print(f"{r['shape'] + '/' + r['path']:<20}{(dev or 0) / 1e6:>11.3f}{r['cached_samples_per_s'] / 1e6:>11.3f}"
          f"{r['ratio'] or 0:>7.3f}{r['cache_hit_rate'] or 0:>9.3f}  {moved['read']:>5.3f}/{moved['written']:<5.3f}"
          f"{r['host_gib']:>9.1f}{peak:>9.1f}")
path = pathlib.Path(sys.argv[1]) / "onehot256_x2.json"
if path.exists() and path.read_text().strip():
    r = json.loads(path.read_text().splitlines()[-1])
    print(f"onehot-dim256, 2 GPUs all on them: {r['samples_per_s'] / 1e6:.2f} M/s, "
          f"{r['samples_per_s'] / r['world_size'] / 1e6:.2f} M a GPU")
PY
