#!/usr/bin/env bash
# Run the given tests N times in a row beside K busy processes (CPU hogs), and say how many passed.
# A timing test that passes here does not depend on having the machine to itself.
#
#   scripts/repeat_under_load.sh 20 2 test/test_nodes_extractor.py::test_burst_keeps_only_the_newest_frame
set -u -o pipefail
cd "$(dirname "$0")/.."
runs=$1 hogs=$2
shift 2
PY=${PYTHON:-.venv/bin/python}
pids=()
for _ in $(seq "$hogs"); do
    "$PY" -c "while True: pass" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
passed=0
for i in $(seq "$runs"); do
    if "$PY" -m pytest -q -p no:cacheprovider "$@" > /tmp/repeat_under_load.$$.log 2>&1; then
        passed=$((passed + 1))
    else
        echo "run $i failed:"
        tail -30 /tmp/repeat_under_load.$$.log
    fi
done
echo "$passed of $runs passed beside $hogs busy processes (load average $(cut -d' ' -f1-3 /proc/loadavg)): $*"
[ "$passed" -eq "$runs" ]
