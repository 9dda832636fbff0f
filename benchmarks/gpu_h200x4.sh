#!/usr/bin/env bash
# 4 H200s (device kind nvidia-h200-x4; works on -x2 with WORLDS="1 2"), from the repo root:
# sharded MLPerf-shape DLRM on 1, 2, 4 GPUs; dim 256 (> 141 GB) where one GPU cannot hold it;
# NCCL parity tests. Every step has its own time limit; a table of results is printed last.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"
WORLDS=${WORLDS:-"1 2 4"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -8
for dim in 128 256; do
  for n in $WORLDS; do
    echo "== sharded_scale dim $dim on $n GPU(s)"
    timeout ${SCALE_LIMIT:-60} python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/sharded_scale.py \
      --dim "$dim" --precision bf16 > "$OUT/scale_d${dim}_n${n}.json" 2> "$OUT/scale_d${dim}_n${n}.err"
    echo "rc $?"; grep -v "^\s*$" "$OUT/scale_d${dim}_n${n}.err" | tail -4 | cut -c1-300
  done
done
echo "== fused training test (one GPU)"
CUDA_VISIBLE_DEVICES=0 timeout ${FUSED_LIMIT:-60} python3 -m pytest -q tests/gpu/test_train_fused_gpu.py -p no:cacheprovider \
  2>&1 | tee "$OUT/fused_train_test.txt" | tail -4
echo "== NCCL parity tests"
timeout ${TEST_LIMIT:-210} python3 -m pytest -q tests/gpu/test_sharded_nccl.py -p no:cacheprovider 2>&1 \
  | tee "$OUT/nccl_tests.txt" | tail -12
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows, one = [], {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("scale_d*_n*.json")):
    text = path.read_text().strip().splitlines()
    r = json.loads(text[-1]) if text else {}
    if not r:
        print(f"{path.name}: no result"); continue
    if r.get("fits") and r["world_size"] == 1:
        one[r["dim"]] = r["samples_per_s"]
    rows.append(r)
print("dim | GPUs | fits | GiB/GPU (peak) | step ms | samples/s | per GPU | vs 1 GPU")
for r in rows:
    if not r.get("fits"):
        print(f"{r['dim']} | {r['world_size']} | no ({r.get('error', '')[:80]}) |"); continue
    base = one.get(r["dim"])
    ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
    mem = "/".join(f"{m:.0f}" for m in r["memory_gib_per_process"])
    print(f"{r['dim']} | {r['world_size']} | yes | {mem} | {r['step_ms']:.1f} | {r['samples_per_s'] / 1e6:.2f} M |"
          f" {r['samples_per_s'] / r['world_size'] / 1e6:.2f} M | {ratio}")
PY
