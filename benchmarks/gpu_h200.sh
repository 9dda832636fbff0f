#!/usr/bin/env bash
# One H200 machine, from the repo root: GPU tests of the fused path, the loader
# alone, DLRM training throughput, the fp8 cross layers alone, then DCNv2's (bf16 and fp8, the
# benchmark and the `ctrflow train` step). Every step has its own time limit; results land in $OUT.
# PARTS picks steps (default all: "loader tests dlrm fp8cross dcnv2"); TESTS, DCN_PATHS, QUALITY_SEEDS
# and the *_LIMIT variables narrow a call (stderr of the benchmarks: $OUT/log.txt), e.g.
#   PARTS="tests fp8cross dcnv2" TESTS="tests/gpu/test_fp8_cross_gpu.py" bash benchmarks/gpu_h200.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ctrflow-gpu}; mkdir -p "$OUT"
PARTS=${PARTS:-loader tests dlrm fp8cross dcnv2}
TESTS=${TESTS:-tests/gpu/test_fused_dense_gpu.py tests/gpu/test_fused_embedding.py tests/gpu/test_train_fused_gpu.py \
tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_cross_gpu.py tests/gpu/test_train_graphs_gpu.py}
DCN_PATHS=${DCN_PATHS:-fused-compile-head:fp8,fused-compile-head:fp8:noabsorb,fused-compile-head:fp8:unfused,fused-compile-head,loop:fp8,naive}
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if has loader; then echo "== loader"; timeout 90 python3 benchmarks/loader_throughput.py | tee "$OUT/loader.json"; fi
if has tests; then
  echo "== gpu tests"
  # shellcheck disable=SC2086
  timeout ${TEST_LIMIT:-200} python3 -m pytest -q $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
fi
if has dlrm; then
  echo "== dlrm"
  timeout ${DLRM_LIMIT:-150} python3 benchmarks/train_throughput.py --paths naive,fused-compile --quality-steps 100 \
    --profile "$OUT" 2>> "$OUT/log.txt" | tee "$OUT/dlrm.json"
fi
if has fp8cross; then
  echo "== fp8 cross layers alone"
  # shellcheck disable=SC2086
  timeout ${CROSS_LIMIT:-120} python3 benchmarks/fp8_cross.py ${CROSS_ARGS:-} 2>> "$OUT/log.txt" | tee "$OUT/fp8_cross.json"
fi
if has dcnv2; then
  echo "== dcnv2"
  timeout ${DCN_LIMIT:-300} python3 benchmarks/train_throughput.py --model dcnv2 --paths "$DCN_PATHS" \
    --quality-steps 100 --quality-seeds ${QUALITY_SEEDS:-3} --profile "$OUT" 2>> "$OUT/log.txt" | tee "$OUT/dcnv2.json"
  grep '^{' "$OUT/log.txt" | tail -20
fi
