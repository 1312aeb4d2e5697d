#!/usr/bin/env bash
# Runs the given pytest arguments N times in a row while another process keeps one core busy, and stops at the
# first failure: how a timing-dependent test is found before CI finds it.
#   scripts/repeat-tests.sh 20 tests/test_server.py tests/test_server_limits.py tests/test_dataset.py
set -uo pipefail
runs=$1; shift
python -c "while True: pass" &  # the other process loading the CPU
loader=$!
trap 'kill $loader 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    if ! python -m pytest -q -p no:cacheprovider -x "$@" > "/tmp/repeat-tests.$i.log" 2>&1; then
        echo "run $i of $runs FAILED (load $(cut -d' ' -f1 /proc/loadavg)): /tmp/repeat-tests.$i.log"
        tail -5 "/tmp/repeat-tests.$i.log"
        exit 1
    fi
    echo "run $i of $runs passed in $(( $(date +%s) - start )) s (load $(cut -d' ' -f1 /proc/loadavg)): $(tail -1 "/tmp/repeat-tests.$i.log")"
done
echo "$runs runs in a row passed: $*"
