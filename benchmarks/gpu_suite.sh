#!/usr/bin/env bash
# One device run: environment, GPU test suite (plus the video-processor parity tests, which need the
# torchvision the GPU machine has), benchmarks. Everything lands under $OUT.
# Usage on the GPU machine: bash benchmarks/gpu_suite.sh [tests|attention|tower|service|service-fp8|service-mixed|
# soak|all]..., or across device commands (what takes longer than one): benchmarks/device_run.sh.
# The GPU machine lacks the server's web stack: carry its py3.12 wheels (README of the device tool) for fastapi,
# fastapi-offline, starlette, uvicorn, httptools, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# typing-inspection, annotated-types, opentelemetry-api, python-multipart, orjson, pybase64, simplejpeg, av and
# uvloop (uvicorn[standard] brings it to every install: without it the HTTP figures are asyncio's, not a user's), and
# py-spy (the profiles: the machine's image has none; its wheel's binary lands in /tmp/site/bin), and set
# GIT_REVISION (the device's copy of .git may be stale) before bench_service.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")
for step in "${@:-all}"; do
  case $step in
    # the GPU tests: tests/gpu, and the GPU half of each kernel's file under tests/kernels (marked gpu; their other
    # half runs in Triton's interpreter, in CI)
    # (with pytest-xdist, in 4 processes a file each: most of their time is Triton compiling, on the CPU); and the
    # CPU parity tests against transformers, which CI runs with its 5.23, with the machine's release (5.17 on H200s)
    tests|all) { python -m pytest -q -x -p no:cacheprovider $XDIST tests/gpu tests/test_video.py
                 CUDA_VISIBLE_DEVICES= python -m pytest -q -x -p no:cacheprovider $XDIST tests/test_llm_layouts.py \
                   tests/test_preprocess.py tests/test_qwen2_5_vl.py tests/test_parity_transformers.py
                 python -m pytest -q -x -p no:cacheprovider $XDIST -m gpu tests/kernels; } 2>&1 \
                 | tee "$OUT/gpu_tests.log" | tail -n 15 ;;&
    kernel-tests) python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -n 15 ;;
    # the kernels' GPU tests in two parts, each within one 600 s device call
    kernel-tests-a) python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels -k every_candidate 2>&1 \
                      | tee "$OUT/gpu_kernel-tests-a.log" | tail -n 15 ;;
    kernel-tests-b) python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels -k "not every_candidate" 2>&1 \
                      | tee "$OUT/gpu_kernel-tests-b.log" | tail -n 15 ;;
    fp8-tests) python -m pytest -q -x -p no:cacheprovider ${XDIST/loadfile/load} -m gpu tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8.py \
                 tests/kernels/test_act_quant.py tests/kernels/test_add_layernorm.py tests/test_fp8_tower.py 2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -n 15 ;;
    fp8-error) python -m benchmarks.fp8_error --out "$OUT" 2>&1 | tee "$OUT/fp8_error.log" | tail -n 12 ;;
    # Qwen2.5-VL's towers beside the others: their own tower_qwen2_5.json
    tower-qwen2.5) python -m benchmarks.bench_tower --presets qwen2.5-vl-7b --out "$OUT/qwen2_5" ${TOWER_ARGS:-} 2>&1 \
                     | tee "$OUT/bench_tower_qwen2_5.log" && cp "$OUT/qwen2_5/tower.json" "$OUT/tower_qwen2_5.json" ;;
    qkv-tests) python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_qkv_rope.py 2>&1 \
                 | tee "$OUT/gpu_qkv_tests.log" | tail -n 15 ;;
    # the engine's way in and out on a GPU: arena frames, the copy streams, a lone frame's graph
    engine-tests) python -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_engine.py 2>&1 \
                    | tee "$OUT/gpu_engine_tests.log" | tail -n 15 ;;
    tower-tests) python -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_gpu_tower.py 2>&1 | tee "$OUT/gpu_tower_tests.log" | tail -n 25 ;;
    attention|all) python -m benchmarks.bench_attention --out "$OUT" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/bench_attention.log" ;;&
    qkv) python -m benchmarks.bench_qkv_rope 2>&1 | tee "$OUT/bench_qkv_rope.log" ;;
    memcheck) compute-sanitizer --tool memcheck python -m tools.check_attention_memory 2>&1 \
                | tee "$OUT/memcheck.log" | tail -n 25 ;;
    # the served path's forward against the eager one on the same packs, kernel by kernel (profile_served.json)
    profile-served) python -m tools.profile_served --out "$OUT" 2>&1 | tee "$OUT/profile_served.log" ;;
    # a lone image's own graph against its served bucket, kernel by kernel (bucket_kernels.json), and the blocks'
    # GEMMs by row count, with TunableOp beside (gemm_rows.json, gemm_rows_tunableop.json)
    bucket-kernels) python -m tools.bucket_kernels --out "$OUT" 2>&1 | tee "$OUT/bucket_kernels.log" ;;
    gemm-rows) python -m tools.gemm_rows --out "$OUT" 2>&1 | tee "$OUT/gemm_rows.log"
               python -m tools.gemm_rows --tunableop --rows 736 864 16 --out "$OUT" 2>&1 | tee -a "$OUT/gemm_rows.log" ;;
    profile) python -m tools.profile_tower --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_tower.log" ;;
    sweep) for g in ${SWEEP_GROUPS:-baseline ptr gluon}; do
             timeout ${SWEEP_TIMEOUT:-240} python -m tools.sweep_attention --group $g --out "$OUT/sweep.jsonl" \
               ${SWEEP_ARGS:-} > "$OUT/sweep_$g.log" 2>&1 || echo "sweep group $g: exit $?"
           done ;;
    tower|all) python -m benchmarks.bench_tower --out "$OUT" ${TOWER_ARGS:-} 2>&1 | tee "$OUT/bench_tower.log" ;;&
    # the served throughput at the defaults under the compiled and the aiohttp generators against the forward
    # (service.json), with every graph bucket captured (service_all_buckets.json: the start-up's eager limit off), the
    # FP8 tower's (service_fp8.json), and mixed photos, cold and warm (service_mixed.json): each within a device call
    service|all) python -m benchmarks.bench_service --out "$OUT" ${SERVICE_ARGS:-} 2>&1 \
                   | tee "$OUT/bench_service.log" ;;&
    service-all-buckets) QWEN3VL_CUDA_GRAPH_EAGER_ABOVE=false python -m benchmarks.bench_service \
                           --out "$OUT/all_buckets" 2>&1 | tee "$OUT/bench_service_all_buckets.log"
                         cp "$OUT/all_buckets/service.json" "$OUT/service_all_buckets.json" ;;
    service-fp8|all) QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.bench_service --out "$OUT" 2>&1 \
                       | tee "$OUT/bench_service_fp8.log" ;;&
    service-mixed|all) python -m benchmarks.bench_service --mixed --out "$OUT" 2>&1 \
                         | tee "$OUT/bench_service_mixed.log" ;;
    # where packs leave the graph buckets: the served path against the eager forward by pack size, bf16 and FP8
    # (buckets.json, buckets_fp8.json)
    buckets) python -m benchmarks.bench_buckets --out "$OUT" 2>&1 | tee "$OUT/bench_buckets.log"
             QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.bench_buckets --out "$OUT" 2>&1 | tee "$OUT/bench_buckets_fp8.log" ;;
    kernels) python -m benchmarks.bench_kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" ;;
    # device_multigpu.sh's steps (multigpu-tests, multigpu-startup, multigpu-bf16, multigpu-fp8, ...), so that one
    # device_run.sh start chains them with the single-GPU steps on a multi-GPU machine
    multigpu-*) bash benchmarks/device_multigpu.sh "${step#multigpu-}" ;;
    startup) python -m benchmarks.bench_service --startup-only --out "$OUT" > "$OUT/bench_service_startup.log" 2>&1
             tail -n 3 "$OUT/bench_service_startup.log" ;;
    # the served throughput of the carried revisions' servers (.ab/REV.tar of `git archive REV service kernels`, or
    # a whole tree as `ab` takes) and this tree's, under the compiled generator (ab_served.json; AB_SERVED_ARGS:
    # --clients, --rounds, --variant)
    ab-served) python -m benchmarks.ab_served --out "$OUT" ${AB_SERVED_ARGS:-} 2>&1 | tee "$OUT/ab_served.log" ;;
    # one benchmark at other revisions beside this tree's, alternated twice on one machine (a host's speed differs
    # from lease to lease, so only a comparison within one lease says what a revision changed): carry .ab, made
    # here with `mkdir -p .ab && git archive REV > .ab/REV.tar`; AB_ARGS are bench_service's (--startup-only: the
    # lone image and the start-up; AB_ROUNDS: the rounds, "1 2" unless given). Results under
    # $OUT/ab-<revision or "head">-<round> (one level: the device tool leaves out deeper folders).
    ab) for round in ${AB_ROUNDS:-1 2}; do
          for tree in .ab/*.tar head; do
            name=$(basename "$tree" .tar); dir=$PWD
            if [ "$name" != head ]; then
              dir=/tmp/ab/$name; [ -d "$dir" ] || { mkdir -p "$dir" && tar -xf "$tree" -C "$dir"; }
            fi
            res="$OUT/ab-$name-$round"; mkdir -p "$res"
            (cd "$dir" && GIT_REVISION=${name/head/${GIT_REVISION:-head}} PYTHONPATH=$dir:${PYTHONPATH#*:} \
               python -m benchmarks.bench_service ${AB_ARGS:---startup-only} --out "$res" \
               > "$res/bench_service.log" 2>&1; tail -n 1 "$res/bench_service.log")
          done
        done ;;
    # on a machine of two or more GPUs: the GPU tests on GPU 0 and the kernels' on GPU 1 (in 12 processes: compiling
    # is most of their time), at once
    tests-2gpu) CUDA_VISIBLE_DEVICES=1 python -m pytest -q -x -p no:cacheprovider -n 12 --dist load -m gpu tests/kernels \
                  > "$OUT/gpu_kernel_tests.log" 2>&1 &
                CUDA_VISIBLE_DEVICES=0 python -m pytest -q -x -p no:cacheprovider $XDIST tests/gpu tests/test_video.py \
                  > "$OUT/gpu_tests.log" 2>&1
                wait; tail -n 4 "$OUT/gpu_tests.log" "$OUT/gpu_kernel_tests.log" ;;
    # the vLLM layout beside the tokens under the compiled generator, at 256 and 64 MiB of shared memory, over the
    # served forward (32 images, and one alone for the lone request) timed first in the same call (epd.json)
    epd) python -m benchmarks.bench_tower --presets qwen3-vl-2b --workloads 1x448px 32x448px --no-compile --no-fp8 \
           --out "$OUT/epd_forward" > "$OUT/epd_forward.log" 2>&1
         python -m benchmarks.bench_epd --forward "$OUT/epd_forward/tower.json" --out "$OUT" 2>&1 \
           | tee "$OUT/bench_epd.log" ;;
    # issue 57's open loop: 90% of the closed-loop capacity, images only, 2 minutes (openloop_p99.json)
    openloop-p99) python -m benchmarks.soak --minutes 2 --fraction 0.9 --video-every 0 --name openloop_p99 \
                    --out "$OUT" > "$OUT/openloop_p99.log" 2>&1 ;;
    # 20 minutes and more: start it with benchmarks/device_run.sh (a session of its own) and collect soak.json with
    # its `wait`. Carry the generator, built here: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go
    soak) python -m benchmarks.soak --out "$OUT" ${SOAK_ARGS:-} > "$OUT/soak.log" 2>&1 ;;
    # on a machine of two GPUs: the soak on GPU 0 and, once it has measured its capacity (their compiles would lower
    # it), the start-up benchmark and the GPU tests (two processes) one after another on GPU 1
    soak-beside) CUDA_VISIBLE_DEVICES=0 python -m benchmarks.soak --out "$OUT" ${SOAK_ARGS:-} > "$OUT/soak.log" 2>&1 &
                 soak=$!
                 until grep -q "^capacity" "$OUT/soak.log" || ! kill -0 $soak 2>/dev/null; do sleep 5; done
                 export CUDA_VISIBLE_DEVICES=1
                 python -m benchmarks.bench_service --startup-only --out "$OUT" > "$OUT/bench_service_startup.log" 2>&1
                 python -m pytest -q -x -p no:cacheprovider ${XDIST/-n 4/-n 2} tests/gpu > "$OUT/gpu_tests.log" 2>&1
                 unset CUDA_VISIBLE_DEVICES; wait $soak
                 tail -n 3 "$OUT/bench_service_startup.log" "$OUT/gpu_tests.log" "$OUT/soak.log" ;;
  esac
done
