#!/bin/bash
# Profile the coordinator with py-spy during a qlayer at-least-once throughput cell (1 KiB, 4
# consumers, 30 × 20,000 messages, each within the payload budget); the raw profile goes to benchmarks/results/coordinator-profile.txt,
# which benchmarks/report.py summarises in docs/benchmarks.md. Extra arguments go to bench.py
# (e.g. --bootstrap-servers ... --database-url ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=benchmarks/results/coordinator-profile.txt
# The commit profiled: report.py quotes the source lines of that version (py-spy's line
# numbers point into it). "dirty" when the tree had uncommitted changes.
{ git rev-parse HEAD; git diff --quiet HEAD -- layer || echo dirty; } \
    > benchmarks/results/coordinator-profile.commit
$PY benchmarks/bench.py --systems qlayer-alo --sizes 1024 --consumer-counts 4 --messages 20000 \
    --repetitions 30 --no-latency --output benchmarks/results/coordinator-profile.json "$@" &
BENCH=$!
COORDINATOR=""
# The coordinator is the first process the harness spawns (the consumers follow 2 s later).
for _ in $(seq 1 100); do
    for child in $(pgrep -P "$BENCH" || true); do
        if grep -q spawn_main "/proc/$child/cmdline" 2>/dev/null \
                && ! grep -q resource_tracker "/proc/$child/cmdline"; then
            COORDINATOR=$child
            break
        fi
    done
    [ -n "$COORDINATOR" ] && break
    sleep 0.2
done
# Past the coordinator's start, the consumers' subscriptions and the warm-up: the repetitions.
sleep 12
.venv/bin/py-spy record -p "$COORDINATOR" -d 12 -f raw -o "$OUT"
wait "$BENCH"
echo "written to $OUT"
