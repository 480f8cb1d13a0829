python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD GIT_REVISION=$REV PYTHONUNBUFFERED=1
mkdir -p $OUT/h1 $OUT/h0 $OUT/p
C="1 7 131 1023 awkward 48x33 1x1024 1x1024+0 64x256+0 8x1024"
timeout 150 python -m benchmarks.probe_gluon_attention --head-dim 72 --cases $C --tiles 128/64/8/2/0/0/1/1 --out $OUT/p > $OUT/p/probe72.log 2>&1; echo rc=$?
timeout 150 python -m benchmarks.probe_gluon_attention --head-dim 64 --cases $C --tiles 128/128/8/2/0/0/1/1 --out $OUT/p > $OUT/p/probe64.log 2>&1; echo rc=$?
python - <<'PY'
import json, os
for d in (72, 64):
    r = json.load(open(os.environ["OUT"] + f"/p/gluon_attention_probe_d{d}.json"))
    for row in r["rows"]:
        g = {k[6:]: round(v, 1) for k, v in row["us"].items() if k.startswith("gluon")}
        e = {k[6:]: f"{v:.1e}" for k, v in row["rel_err"].items() if k.startswith("gluon")}
        print(d, row["case"], g, "cudnn", round(row["us"].get("cudnn", 0), 1), e, list(row["errors"]))
PY
for H in 1 0; do
QWEN3VL_WS_HALVES=$H timeout 120 python -m benchmarks.probe_cold --head-dim 72 --cases 1x1024 64x256 --reps 100 --tiles 128/64/8/2/0/0/1/1 --out $OUT/h$H > $OUT/h$H/cold72.log 2>&1; echo rc=$?
QWEN3VL_WS_HALVES=$H timeout 120 python -m benchmarks.probe_cold --head-dim 64 --cases 1x1024 64x256 --reps 100 --tiles 128/128/8/2/0/0/1/1 64/128/4/2/0/0/1/2 --out $OUT/h$H > $OUT/h$H/cold64.log 2>&1; echo rc=$?
grep -A10 "^case" $OUT/h$H/cold72.log $OUT/h$H/cold64.log
done
