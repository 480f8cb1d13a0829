#!/usr/bin/env bash
# One device command on a multi-GPU machine: the carried web stack (.whl), then the named steps, results under $OUT.
#   tests    tests/gpu/test_multi_gpu.py (two or more GPUs)
#   startup  benchmarks.multigpu --part startup
#   bf16     benchmarks.multigpu --part scaling
#   fp8      the same with QWEN3VL_QUANTIZATION=fp8
# The generator comes built (.bin/openloop: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/multigpu_gpus.txt"
nproc >> "$OUT/multigpu_gpus.txt"
for step in "$@"; do
  case $step in
    tests) timeout 300 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_multi_gpu.py 2>&1 | tee "$OUT/multigpu_tests.log" | tail -n 15 ;;
    startup) python -m benchmarks.multigpu --part startup --out "$OUT" 2>&1 | tee "$OUT/multigpu_startup.out" | tail -n 30 ;;
    bf16) python -m benchmarks.multigpu --part scaling --out "$OUT" 2>&1 | tee "$OUT/multigpu_bf16.out" | grep -v "^ " | tail -n 30 ;;
    fp8) QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.multigpu --part scaling --out "$OUT" 2>&1 | tee "$OUT/multigpu_fp8.out" | grep -v "^ " | tail -n 30 ;;
  esac
done
