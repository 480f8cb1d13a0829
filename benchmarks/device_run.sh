#!/usr/bin/env bash
# gpu_suite.sh steps on the lent GPU machine, across several device commands. The device tool ends a command's
# processes when the command returns, unless they run in a session of their own; so `start` launches the suite in
# one (setsid) and returns, and each `wait` waits up to N seconds, shows progress and copies everything written so
# far into $OUT, results as files and the logs in logs.tgz (the machine goes back after 30 s idle: issue the next
# `wait` at once).
# The suite runs in a copy of the tree under $RUN_DIR: the device tool rewrites the working tree at every command,
# and a server that imports a module while that happens fails (the soak at d9b6912 lost two video requests so).
#   GIT_REVISION=abc1234 bash benchmarks/device_run.sh start tests attention service   (carry .whl, and .bin for soak)
#   bash benchmarks/device_run.sh wait 540
# Follow a start only with `wait` calls, never a bare `sleep`: a call that comes later than 30 s after the last one
# lands on a fresh machine, where `wait` says so at once and a sleep spends its whole length for nothing.
# Machines went back between two calls issued back to back (twice on 2026-11-27, with the run half done): where the
# steps allow, prefer calls that each run whole steps in the foreground within the 600 s limit
# (`bash benchmarks/gpu_suite.sh multigpu-fp8` in one call, `multigpu-bf16-scaling multigpu-startup` in the next), so
# that a lost machine costs a fresh start and not the run in progress.
set -uo pipefail
RUN_DIR=${RUN_DIR:-/tmp/device_run}
case ${1:-} in
  start)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1 || { echo "cannot install .whl/*.whl: carry .whl"; exit 2; }
    mkdir -p "$RUN_DIR/tree"
    tar --exclude=./.whl --exclude=./.git -cf - . | tar -C "$RUN_DIR/tree" -xf -
    cd "$RUN_DIR/tree" || exit 2
    export PYTHONPATH=/tmp/site:$PWD
    python3 -c "import fastapi, pydantic_settings, av, uvloop, xdist" || { echo "a carried wheel is missing"; exit 2; }
    [ -n "${GIT_REVISION:-}" ] || echo "GIT_REVISION is not set: results record the device copy's HEAD"
    OUT=$RUN_DIR setsid nohup bash -c 'bash benchmarks/gpu_suite.sh "$@"; echo $? > "$OUT/DONE"' suite "$@" \
      > "$RUN_DIR/suite.log" 2>&1 < /dev/null &
    echo "started in its own session: $*" ;;
  wait)
    # a fresh machine (the last one went back between calls) has no run: say so at once rather than wait
    [ -d "$RUN_DIR" ] || { echo "no run in $RUN_DIR: this machine is a fresh one, start again"; exit 3; }
    deadline=$((SECONDS + ${2:-540}))
    while [ ! -f "$RUN_DIR/DONE" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    tail -n 8 "$RUN_DIR/suite.log"
    if [ -f "$RUN_DIR/DONE" ]; then echo "done: exit $(cat "$RUN_DIR/DONE")"; else echo "still running"; fi
    # the device tool brings back at most 8 files a call: the results (JSON, PNG) one by one, everything else in
    # one archive
    find "$RUN_DIR" -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' -o -name DONE \) -exec cp {} "${OUT:?}/" \;
    (cd "$RUN_DIR" && find . -maxdepth 1 -type f ! -name '*.json' ! -name '*.png' ! -name DONE -print0 \
       | tar --null -czf "${OUT:?}/logs.tgz" -T -) ;;
  *) echo "usage: $0 start STEP... | wait SECONDS"; exit 2 ;;
esac
