#!/usr/bin/env bash
# Several H200s of one host, from the repo root: MLPerf DLRMv2 (benchmarks/dlrmv2_scale.py) at MLPerf's global
# batch of 55,296 on 1, 2, 4... GPUs, then the GPU tests of the sharded multi-hot bags; a table last.
# RUNS: space-separated phases; a phase is runs joined by "+" that run side by side on disjoint GPUs; a run
# is "name@GPUS@flags" (GPUS a CUDA_VISIBLE_DEVICES list, flags with commas for spaces; a flag "src=DIR" runs
# that ctrflow tree instead of src/), or "tests@GPUS" (the sharded and fused bag GPU tests there). Default:
# 1 GPU beside 2, then 4, then the tests. PROFILE=1 adds --profile to every run. Limits (seconds):
# RUN_LIMIT, TEST_LIMIT. Results: $OUT/scale.tgz (every
# run's JSON, stderr and kernel tables) and $OUT/summary.txt.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/ctrflow-gpu}; RES=$(mktemp -d); mkdir -p "$OUT"
RUNS=${RUNS:-"x1@0@+x2@1,2@ x4@0,1,2,3@ tests@0,1"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'
gpu_tests() {  # GPUs
  echo "== GPU tests on [$1]: sharded bags (NCCL), fused bags"
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=src timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_sharded_nccl.py tests/gpu/test_fused_bags_gpu.py > "$RES/tests.txt" 2>&1
  echo "== GPU tests: rc $?"; tail -3 "$RES/tests.txt"
}
launch() {  # name, GPUs, flags
  [ "$1" = tests ] && { gpu_tests "$2"; return; }
  local name=$1 gpus=$2 flags=${3//,/ } src=src n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  case "$flags" in src=*) src=${flags%% *}; src=${src#src=}; flags=${flags#src=$src};; esac
  [ "${PROFILE:-0}" = 1 ] && { mkdir -p "$RES/$name"; flags="$flags --profile $RES/$name"; }
  echo "== $name: $n GPU(s) [$gpus] $src $flags"
  CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=$src timeout "${RUN_LIMIT:-150}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$n" benchmarks/dlrmv2_scale.py $flags > "$RES/$name.json" 2> "$RES/$name.err"
  echo "== $name: rc $?"
}
for phase in $RUNS; do
  pids=""
  for run in ${phase//+/ }; do
    IFS=@ read -r name gpus flags <<< "$run"
    launch "$name" "$gpus" "$flags" & pids="$pids $!"
  done
  wait $pids
done
python3 - "$RES" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
from collections import Counter
res = pathlib.Path(sys.argv[1])
def record(path):
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}
runs = {p.stem: record(p) for p in sorted(res.glob("*.json"))}
ones = [r["samples_per_s"] for r in runs.values() if r.get("world_size") == 1]
print("run | GPUs | plan | step ms | M samples/s | per GPU | x one GPU | peak GiB/GPU | loss first, last")
for name, r in runs.items():
    if not r:
        err = (res / f"{name}.err").read_text().strip().splitlines()
        print(f"{name} | no result: {err[-1][:200] if err else ''}")
        continue
    plan = ", ".join(f"{k} {n}" for k, n in Counter(v.split("@")[0] for v in r["plan"].values()).most_common())
    mem = "/".join(f"{m:.0f}" for m in r["memory_gib_per_process"])
    ratio = f"{r['samples_per_s'] / ones[0]:.2f}x" if ones else "-"
    print(f"{name} | {r['world_size']} | {plan}{' graphed' if r['graph'] else ''} | {r['step_ms']:.2f} | "
          f"{r['samples_per_s'] / 1e6:.2f} | {r['samples_per_s'] / r['world_size'] / 1e6:.2f} | {ratio} | {mem} | "
          f"{r['losses'][0]:.4f}, {r['losses'][-1]:.4f}")
PY
tar czf "$OUT/scale.tgz" -C "$RES" .
