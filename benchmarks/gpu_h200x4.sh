#!/usr/bin/env bash
# 4 H200s of one host, from the repo root: the fused one-GPU baseline
# (train_throughput.py fused-compile) and the hybrid-parallel fused path on 4 (and 2) GPUs
# (sharded_scale.py), MLPerf Criteo-1TB DLRM shape, batch 65,536 per GPU, bf16; then the GPU tests.
# Every step has its own time limit; a table of results is printed last. Knobs: RUNS (space-separated
# "name:GPUs:extra flags[:VAR=value,...]" with commas for spaces; the optional fourth field sets environment
# variables for that run only, e.g. NCCL_MAX_CTAS=8), run first on the idle machine; then, side by side, the
# one-GPU baseline on GPU 0 (BASE=0 skips it) followed by AFTER_BASE (a command on GPU 0, its stdout
# printed), BESIDE (a pytest selection on GPUs BESIDE_GPUS, default 1,2,3) and BESIDE_ONE (one
# on GPU 3, then give BESIDE_GPUS=1,2), each cut at BESIDE_LIMIT seconds; TESTS (pytest selection on all
# GPUs, empty skips them; TEST_FILTER a -k expression, TEST_ARGS more pytest arguments such as -s) last, or
# first with TESTS_FIRST=1 (before RUNS). On 2 GPUs: BESIDE_GPUS=1.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (no TORCH_NCCL_ASYNC_ERROR_HANDLING=0 for --graph: captured NCCL calls never reach the watchdog)
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"; ERR=$(mktemp -d)  # stderr apart: few files come back
RUNS=${RUNS:-"fused4:4:--profile,$OUT fused4g:4:--graph fused2g:2:--graph plain4:4:--embedding,plain"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1
gpu_tests() {
  [ -n "${TESTS-tests/gpu/test_sharded_nccl.py tests/gpu/test_train_fused_gpu.py tests/gpu/test_fused_embedding.py}" ] || return 0
  echo "== GPU tests"
  timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-} \
    ${TESTS-tests/gpu/test_sharded_nccl.py tests/gpu/test_train_fused_gpu.py tests/gpu/test_fused_embedding.py} \
    ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/tests.txt" | grep -v "^\s*$" | tail -${TEST_LINES:-15}
}
[ "${TESTS_FIRST:-0}" = 1 ] && gpu_tests
for run in $RUNS; do
  name=${run%%:*}; rest=${run#*:}; n=${rest%%:*}; extra=${rest#*:}; envs=""
  case "$extra" in *:*) envs=${extra#*:}; envs=${envs//,/ }; extra=${extra%%:*};; esac
  extra=${extra//,/ }
  echo "== $name: sharded_scale on $n GPUs $extra ${envs:+(env $envs)}"
  env $envs timeout ${SCALE_LIMIT:-100} python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/sharded_scale.py \
    --precision bf16 $extra > "$OUT/$name.json" 2> "$ERR/$name.err"
  echo "rc $?"; grep -v "^\s*$" "$ERR/$name.err" | grep -iv "warn\|sparse_coo\|OMP_NUM\|\*\*\*\*" | tail -${ERR_LINES:-3} | cut -c1-300
done
pids=""
if [ -n "${BESIDE:-}" ]; then
  CUDA_VISIBLE_DEVICES=${BESIDE_GPUS:-1,2,3} timeout ${BESIDE_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider \
    $BESIDE > "$ERR/tests_beside.txt" 2>&1 &
  pids="$pids $!"
fi
if [ -n "${BESIDE_ONE:-}" ]; then
  CUDA_VISIBLE_DEVICES=3 timeout ${BESIDE_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider \
    $BESIDE_ONE > "$ERR/tests_beside_one.txt" 2>&1 &
  pids="$pids $!"
fi
if [ "${BASE:-1}" != 0 ]; then
  echo "== one GPU, fused-compile baseline"
  CUDA_VISIBLE_DEVICES=0 timeout ${BASE_LIMIT:-150} python3 benchmarks/train_throughput.py --paths fused-compile \
    --quality-steps 0 --repeats 3 > "$OUT/base.json" 2> "$ERR/base.err"; echo "rc $?"; tail -2 "$ERR/base.err" | cut -c1-300
fi
if [ -n "${AFTER_BASE:-}" ]; then
  echo "== on GPU 0: $AFTER_BASE"
  CUDA_VISIBLE_DEVICES=0 timeout ${AFTER_LIMIT:-60} $AFTER_BASE > "$ERR/after.out" 2> "$ERR/after.err"
  echo "rc $?"; cat "$ERR/after.out"; tail -3 "$ERR/after.err" | cut -c1-300
fi
for pid in $pids; do wait $pid; echo "== tests beside (pid $pid): rc $?"; done
for f in "$ERR"/tests_beside*.txt; do  # one file back for both (few files come back)
  [ -e "$f" ] && { echo "== $(basename "$f")"; grep -v "^\s*$" "$f" | tail -${TEST_LINES:-15}; cat "$f" >> "$OUT/tests_beside.txt"; }
done
table() {
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def last(path):
    lines = path.read_text().strip().splitlines() if path.exists() else []
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}
base = last(out / "base.json").get("fused-compile", {}).get("samples_per_s")
print("run | GPUs | embedding | chunks, options | step ms | samples/s | per GPU | vs fused 1 GPU | peak GiB/GPU")
print(f"base | 1 | fused-compile (train_throughput) | - | - | {base / 1e6:.2f} M | | 1.00x |" if base else "base | no result")
for path in sorted(out.glob("*.json")):
    r = last(path)
    if path.stem == "base" or r.get("benchmark") != "sharded_scale":
        continue
    if not r.get("fits"):
        print(f"{path.stem} | {r.get('world_size')} | no: {r.get('error', '')[:80]}"); continue
    ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
    mem = "/".join(f"{m:.0f}" for m in r["memory_gib_per_process"])
    flags = "".join(f" {k}" for k in ("in_place", "route_ahead", "work_ahead") if r.get(k))
    flags += f" {r.get('dense_comm', '')}" + ("" if r.get("compiled", True) else " eager-dense")
    print(f"{path.stem} | {r['world_size']} | {r['embedding']} | {r.get('chunks', 1)}{flags} | {r['step_ms']:.2f} | "
          f"{r['samples_per_s'] / 1e6:.2f} M | {r['samples_per_s'] / r['world_size'] / 1e6:.2f} M | {ratio} | {mem}")
PY
}
table
[ "${TESTS_FIRST:-0}" = 1 ] || gpu_tests
table
