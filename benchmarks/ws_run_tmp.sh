python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD GIT_REVISION=$REV PYTHONUNBUFFERED=1
for L in "[2]" "[7]" "[64]" "[65]" "[129]" "[7,9]"; do timeout 60 python benchmarks/ws_debug_tmp.py 64 64/128/4/2/0/0/1/2 "$L" 2>&1 | grep -E "rel err|Error" | head -1; done
T72="64/64/4/2/0/0/1 64/64/4/2/0/0/1/2 128/64/8/2/0/0/1/1 64/128/4/2/0/0/1/2 128/64/8/2/0/1/1/1"
T64="64/128/4/2/0/0/1 64/128/4/2/0/0/1/2 64/64/4/2/0/0/1/3 128/128/8/2/0/0/1/1"
C="1 7 131 1023 awkward 48x33 1x1024 1x1024+0 64x256 64x256+0 8x1024 mixed8 32x784"
timeout 200 python -m benchmarks.probe_gluon_attention --head-dim 72 --cases $C --tiles $T72 --out $OUT > $OUT/probe72.log 2>&1; echo rc=$?
timeout 200 python -m benchmarks.probe_gluon_attention --head-dim 64 --cases $C --tiles $T64 --out $OUT > $OUT/probe64.log 2>&1; echo rc=$?
python - <<'PY'
import json, os
for d in (72, 64):
    r = json.load(open(os.environ["OUT"] + f"/gluon_attention_probe_d{d}.json"))
    for row in r["rows"]:
        g = {k[6:]: v for k, v in row["us"].items() if k.startswith("gluon")}
        errs = {k[6:]: f"{v:.1e}" for k, v in row["rel_err"].items() if k.startswith("gluon")}
        print(d, row["case"], {k: round(v, 1) for k, v in g.items()}, "cudnn", round(row["us"].get("cudnn", 0), 1), errs, row["errors"] and list(row["errors"]))
PY
