#!/usr/bin/env bash
# 4 H200s (device kind nvidia-h200-x4), from the repo root: the fused one-GPU baseline
# (train_throughput.py fused-compile) and the hybrid-parallel fused path on 4 (and 2) GPUs
# (sharded_scale.py), MLPerf Criteo-1TB DLRM shape, batch 65,536 per GPU, bf16; then the GPU tests.
# Every step has its own time limit; a table of results is printed last. Knobs: RUNS (space-separated
# "name:GPUs:extra flags[:VAR=value,...]" with commas for spaces; the optional fourth field sets environment
# variables for that run only, e.g. NCCL_MAX_CTAS=8), TESTS (pytest selection, empty skips them), BASE=0
# skips the one-GPU baseline, BESIDE (a pytest selection run on GPUs 1-3 while the baseline runs on GPU 0).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=0  # NCCL collectives inside captured CUDA graphs (--graph)
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"; ERR=$(mktemp -d)  # stderr apart: few files come back
RUNS=${RUNS:-"fused4:4:--profile,$OUT fused4g:4:--graph fused2g:2:--graph plain4:4:--embedding,plain"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1
if [ -n "${BESIDE:-}" ]; then
  CUDA_VISIBLE_DEVICES=1,2,3 timeout ${BESIDE_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider $BESIDE \
    > "$OUT/tests_beside.txt" 2>&1 &
  beside=$!
fi
if [ "${BASE:-1}" != 0 ]; then
  echo "== one GPU, fused-compile baseline"
  CUDA_VISIBLE_DEVICES=0 timeout ${BASE_LIMIT:-150} python3 benchmarks/train_throughput.py --paths fused-compile \
    --quality-steps 0 --repeats 3 > "$OUT/base.json" 2> "$ERR/base.err"; echo "rc $?"; tail -2 "$ERR/base.err" | cut -c1-300
fi
if [ -n "${BESIDE:-}" ]; then
  wait $beside; echo "== tests beside the baseline (GPUs 1-3): rc $?"; grep -v "^\s*$" "$OUT/tests_beside.txt" | tail -${TEST_LINES:-15}
fi
for run in $RUNS; do
  name=${run%%:*}; rest=${run#*:}; n=${rest%%:*}; extra=${rest#*:}; envs=""
  case "$extra" in *:*) envs=${extra#*:}; envs=${envs//,/ }; extra=${extra%%:*};; esac
  extra=${extra//,/ }
  echo "== $name: sharded_scale on $n GPUs $extra ${envs:+(env $envs)}"
  env $envs timeout ${SCALE_LIMIT:-100} python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/sharded_scale.py \
    --precision bf16 $extra > "$OUT/$name.json" 2> "$ERR/$name.err"
  echo "rc $?"; grep -v "^\s*$" "$ERR/$name.err" | grep -iv "warn\|sparse_coo\|OMP_NUM\|\*\*\*\*" | tail -${ERR_LINES:-3} | cut -c1-300
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
print("run | GPUs | embedding | chunks | step ms | samples/s | per GPU | vs fused 1 GPU | peak GiB/GPU")
print(f"base | 1 | fused-compile (train_throughput) | - | - | {base / 1e6:.2f} M | | 1.00x |" if base else "base | no result")
for path in sorted(out.glob("*.json")):
    r = last(path)
    if path.stem == "base" or not r:
        continue
    if not r.get("fits"):
        print(f"{path.stem} | {r.get('world_size')} | no: {r.get('error', '')[:80]}"); continue
    ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
    mem = "/".join(f"{m:.0f}" for m in r["memory_gib_per_process"])
    print(f"{path.stem} | {r['world_size']} | {r['embedding']} | {r.get('chunks', 1)}{' in-place' if r.get('in_place') else ''} | {r['step_ms']:.2f} | "
          f"{r['samples_per_s'] / 1e6:.2f} M | {r['samples_per_s'] / r['world_size'] / 1e6:.2f} M | {ratio} | {mem}")
PY
}
table
if [ -n "${TESTS-tests/gpu/test_sharded_nccl.py tests/gpu/test_train_fused_gpu.py tests/gpu/test_fused_embedding.py}" ]; then
  echo "== GPU tests"
  timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider \
    ${TESTS-tests/gpu/test_sharded_nccl.py tests/gpu/test_train_fused_gpu.py tests/gpu/test_fused_embedding.py} \
    ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/tests.txt" | grep -v "^\s*$" | tail -${TEST_LINES:-15}
fi
table
