#!/usr/bin/env bash
# One H200 (device kind nvidia-h200), from the repo root: GPU tests of the fused path, the loader
# alone, DLRM training throughput, then DCNv2's (bf16 and fp8, the benchmark and the `ctrflow train` step). Every step has its own time limit; results land in $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== loader"; timeout 90 python3 benchmarks/loader_throughput.py | tee "$OUT/loader.json"
echo "== gpu tests"
timeout 200 python3 -m pytest -q tests/gpu/test_fused_dense_gpu.py tests/gpu/test_fused_embedding.py \
  tests/gpu/test_train_fused_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_train_graphs_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
echo "== dlrm"
timeout ${DLRM_LIMIT:-150} python3 benchmarks/train_throughput.py --paths naive,fused-compile --quality-steps 100 \
  --profile "$OUT" 2> "$OUT/dlrm.err" | tee "$OUT/dlrm.json"
tail -3 "$OUT/dlrm.err"
echo "== dcnv2"
timeout ${DCN_LIMIT:-200} python3 benchmarks/train_throughput.py --model dcnv2 \
  --paths fused-compile-head:fp8,fused-compile-head,loop,loop:fp8,naive --quality-steps 100 \
  --profile "$OUT" 2> "$OUT/dcnv2.err" | tee "$OUT/dcnv2.json"
tail -3 "$OUT/dcnv2.err"
