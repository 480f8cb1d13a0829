#!/usr/bin/env bash
# Regenerates requirements/dev.lock, the pinned test environment that the README's test command and CI install
# from (pyproject.toml keeps the ranges users install against). Run it on Python 3.11 / Linux x86-64, the CI
# machine's, after changing a range in pyproject.toml or to take upstream releases; then run the tests and commit
# the lock with the change it belongs to.
#   pip install pip-tools && bash requirements/lock.sh            # keep current pins where still allowed
#   pip install pip-tools && bash requirements/lock.sh --upgrade  # take the newest allowed releases
set -euo pipefail
cd "$(dirname "$0")/.."
CUSTOM_COMPILE_COMMAND="bash requirements/lock.sh" pip-compile --quiet --extra dev --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links \
  --output-file requirements/dev.lock "$@" pyproject.toml
# torch is installed first, from PyTorch's CPU index: pin its version, whichever build (+cpu or +cu...) it is.
sed -i -E 's/^torch==([0-9.]+)\+[a-z0-9]+/torch==\1/' requirements/dev.lock
