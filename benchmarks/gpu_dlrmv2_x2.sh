#!/usr/bin/env bash
# 2 H200s of one host, from the repo root, about 6 minutes: MLPerf DLRMv2 (benchmarks/dlrmv2_scale.py) on 2
# GPUs (global batch 55,296: 27,648 each), then the same command on one GPU with the multi-hot bags' one-GPU
# tests beside it on the other (kernels, `ctrflow train` on bags), then the 2-GPU bag tests (sharded plain
# and fused bags against one process, the graphed static bag plan); a table last. Knobs: ARGS (flags of
# every run, e.g. "--precision bf16"), BALANCED=1 (one more 2-GPU run with an explicit plan: the 100-id
# table alone on rank 0), TESTS=0 (no tests), SCALE_LIMIT, BASE_LIMIT, BESIDE_LIMIT, TEST_LIMIT (seconds).
# Results in $OUT: x2.json, x1.json (x2b.json), their .err, tests_bags.txt, tests_sharded.txt.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
scale() {  # name, GPUs, extra flags
  echo "== $1: dlrmv2_scale.py on $2 GPU(s) ${3:-}"
  timeout "${SCALE_LIMIT:-140}" python3 -m torch.distributed.run --standalone --nproc-per-node "$2" \
    benchmarks/dlrmv2_scale.py ${ARGS:-} ${3:-} > "$OUT/$1.json" 2> "$OUT/$1.err"
  echo "rc $?"; grep -v "^\s*$" "$OUT/$1.err" | grep -iv "warn\|OMP_NUM\|\*\*\*\*" | tail -3 | cut -c1-300
}
scale x2 2
if [ "${BALANCED:-0}" = 1 ]; then
  python3 - "$OUT/balanced.json" <<'PY'
import json, sys
rank1 = ["t_C1", "t_C10", "t_C20", "t_C22", "t_C11", "t_C12", "t_C23"]  # 70 ids a sample against t_C21's 100
plan = {"t_C21": {"sharding": "table", "rank": 0}, **{t: {"sharding": "table", "rank": 1} for t in rank1}}
json.dump({"tables": plan}, open(sys.argv[1], "w"))
PY
  scale x2b 2 "--plan $OUT/balanced.json"
fi
pid=""
if [ "${TESTS:-1}" != 0 ]; then  # one-GPU bag kernels on GPU 1, beside the one-GPU run on GPU 0
  CUDA_VISIBLE_DEVICES=1 timeout "${BESIDE_LIMIT:-140}" python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_fused_bags_gpu.py tests/gpu/test_train_multihot_gpu.py > "$OUT/tests_bags.txt" 2>&1 &
  pid=$!
fi
CUDA_VISIBLE_DEVICES=0 SCALE_LIMIT=${BASE_LIMIT:-140} scale x1 1
if [ -n "$pid" ]; then
  wait "$pid"; echo "== one-GPU bag tests: rc $?"; tail -3 "$OUT/tests_bags.txt"
  echo "== 2-GPU bag tests"
  timeout "${TEST_LIMIT:-80}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sharded_nccl.py \
    -k "match_one_fused_process or match_plain_collection or multi_hot" > "$OUT/tests_sharded.txt" 2>&1
  echo "rc $?"; tail -3 "$OUT/tests_sharded.txt"
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
from collections import Counter
out = pathlib.Path(sys.argv[1])
def last(name):
    lines = (out / f"{name}.json").read_text().strip().splitlines() if (out / f"{name}.json").exists() else []
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}
one = last("x1").get("samples_per_s")
print("run | GPUs | precision | plan | step ms | M samples/s | per GPU | x one GPU | peak GiB/GPU | loss first, last")
for name in ("x1", "x2", "x2b"):
    r = last(name)
    if not r:
        if name != "x2b" or (out / "x2b.err").exists():
            print(f"{name} | no result (see {name}.err)")
        continue
    plan = ", ".join(f"{k} {n}" for k, n in Counter(v.split("@")[0] for v in r["plan"].values()).most_common())
    ratio = f"{r['samples_per_s'] / one:.2f}x" if one else "-"
    mem = "/".join(f"{m:.0f}" for m in r["memory_gib_per_process"])
    print(f"{name} | {r['world_size']} | {r['precision']} | {plan}{' graphed' if r['graph'] else ''} | "
          f"{r['step_ms']:.2f} | {r['samples_per_s'] / 1e6:.2f} | {r['samples_per_s'] / r['world_size'] / 1e6:.2f} | "
          f"{ratio} | {mem} | {r['losses'][0]:.4f}, {r['losses'][-1]:.4f}")
PY
