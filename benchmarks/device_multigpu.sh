#!/usr/bin/env bash
# One device command on a multi-GPU machine: the carried web stack (.whl), then the named steps, results under $OUT.
#   tests    tests/gpu/test_multi_gpu.py (two or more GPUs)
#   startup  benchmarks.multigpu --part startup, plus one profiled warm start (py-spy on every process)
#   bf16     benchmarks.multigpu --part scaling, plus every GPU with 24 and 32 front-ends, py-spy on a front-end and
#            an engine under the load at the defaults
#   fp8      the same with QWEN3VL_QUANTIZATION=fp8, with the engine-kill fault test, without the front-end sweep
#   bf16-scaling  the bf16 scaling alone (1, 2 and every GPU; no mixed load, fault, front-end sweep or profile)
#   c512     bf16, one GPU and every GPU under 512 clients (is 256 clients' concurrency what bounds every GPU?)
#   fp8-c512 the same in FP8
#   dataset  benchmarks.bench_dataset: the dataset job on one GPU and on every GPU, bf16 and FP8, and its resume test;
#            py-spy on an engine and a decoding process of each job; DATASET_ARGS (default: 12,000 inputs a GPU, which
#            fits one 600 s device call on 4 GPUs with the forward's timings and the resume test)
#   fp8-ab   benchmarks.ab_served in FP8 on every GPU at 256 clients: each revision in .ab (git archive REV service
#            kernels > .ab/REV.tar; carry .ab) and this tree, one after another, py-spy on an engine of each
# SCALING_ARGS adds to both scaling steps (default: 12 s measured after 4 s of warm-up).
# The generator comes built (.bin/openloop: CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o .bin/openloop
# tools/openloop/main.go; stripped, 4.8 MB, so that .whl, .bin and two .ab trees travel within 64 MiB).
set -uo pipefail
# (under device_run.sh the tree is a copy without .whl, and /tmp/site already holds them)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-benchmarks/results} PATH=/tmp/site/bin:$PATH
# the HTTP figures are a user's install's only on uvloop (uvicorn[standard] brings it)
python3 -c "import uvloop, httptools" || { echo "carry the uvloop and httptools wheels (.whl)"; exit 1; }
SCALING_ARGS=${SCALING_ARGS:---seconds 12 --warmup-s 4}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/multigpu_gpus.txt"
nproc >> "$OUT/multigpu_gpus.txt"
for step in "$@"; do
  case $step in
    tests) timeout 300 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_multi_gpu.py 2>&1 | tee "$OUT/multigpu_tests.log" | tail -n 15 ;;
    startup) python -m benchmarks.multigpu --part startup --profile --out "$OUT" 2>&1 | tee "$OUT/multigpu_startup.out" | tail -n 30 ;;
    bf16) python -m benchmarks.multigpu --part scaling --no-fault --frontends 24,32 --profile $SCALING_ARGS --out "$OUT" 2>&1 | tee "$OUT/multigpu_bf16.out" | grep -v "^ " | tail -n 30 ;;
    bf16-scaling) python -m benchmarks.multigpu --part scaling --no-fault --no-mixed $SCALING_ARGS --out "$OUT" 2>&1 | tee "$OUT/multigpu_bf16_scaling.out" | grep -v "^ " | tail -n 12 ;;
    fp8) QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.multigpu --part scaling --profile $SCALING_ARGS --out "$OUT" 2>&1 | tee "$OUT/multigpu_fp8.out" | grep -v "^ " | tail -n 30 ;;
    c512) python -m benchmarks.multigpu --part scaling --clients 512 --no-fault --no-mixed --no-two $SCALING_ARGS --out "$OUT" 2>&1 | tee "$OUT/multigpu_c512.out" | grep -v "^ " | tail -n 8 ;;
    dataset) python -m benchmarks.bench_dataset --profile ${DATASET_ARGS:---images-per-gpu 12000} --out "$OUT" 2>&1 | tee "$OUT/bench_dataset.log" | grep -v "^RANDOM" | tail -n 16 ;;
    fp8-ab) QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.ab_served --clients 256 --warmup-s 6 --seconds 12 --profile --out "$OUT" 2>&1 | tee "$OUT/ab_served_fp8_4gpu.out" | grep -v "^RANDOM" | tail -n 20 ;;
    fp8-c512) QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.multigpu --part scaling --clients 512 --no-fault --no-mixed --no-two $SCALING_ARGS --out "$OUT" 2>&1 | tee "$OUT/multigpu_fp8_c512.out" | grep -v "^ " | tail -n 8 ;;
  esac
done
