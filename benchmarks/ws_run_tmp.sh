python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD GIT_REVISION=$REV PYTHONUNBUFFERED=1
mkdir -p $OUT/cold
timeout 150 python -m benchmarks.probe_cold --head-dim 64 --cases 1x1024 64x256 --reps 100 --tiles 64/128/4/2/0/0/1 64/128/4/2/0/0/1/2 --out $OUT/cold > $OUT/cold64.log 2>&1; echo rc=$?
timeout 150 python -m benchmarks.probe_cold --head-dim 72 --cases 1x1024 64x256 --reps 100 --tiles 128/64/8/2/0/0/1 128/64/8/2/0/0/1/1 --out $OUT/cold > $OUT/cold72.log 2>&1; echo rc=$?
grep -A14 "^case" $OUT/cold64.log $OUT/cold72.log
timeout 420 python -m benchmarks.bench_attention --head-dims 64 72 > $OUT/bench.log 2>&1; echo rc=$?
grep -v Warning $OUT/bench.log | grep -v "return torch" | tail -40
