#!/usr/bin/env bash
# On a bare GPU machine (no network): install the wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh)
# into /tmp/site, then run scripts/gpu_check.py (about 7.5 minutes in all on an H200).
#
#   scripts/gpu_check.sh [OUT.json] [gpu_check.py flags]
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$here"/.whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:${here}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 "$here/scripts/gpu_check.py" --out "${1:-gpu_check.json}" "${@:2}"
