#!/usr/bin/env bash
# Heap allocations per message through the whole broker (sockets, codec, sessions, broker, store),
# counted by the broker itself (WARREN_COUNT_ALLOCATIONS=1: `warren_heap_allocations_total` in
# /metrics), for the shapes of bench/compare.sh: s9 (a worker that writes each ack before its next
# job, 16 B at 5,000 msg/s), s1 (16 B unthrottled, acks batched), s2r (1 KiB persistent with
# confirms at 5,000 msg/s) and s5 (1 KiB at 10,000 msg/s).
#
#   bench/allocations.sh [--secs S] [--port P]
#
# Each scenario runs once for 2 s to warm up, then for S seconds (default 10) timed; the broker's
# idle allocations over S seconds are measured first and printed beside. Needs release builds of
# warren and warren-bench (WARREN_BIN, WARREN_BENCH; default the release build in
# CARGO_TARGET_DIR).
set -euo pipefail

SECS=10
PORT=5698
while [ $# -gt 0 ]; do
    case "$1" in
    --secs) SECS=$2; shift ;;
    --port) PORT=$2; shift ;;
    *) echo "unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
    shift
done
TARGET=${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}
WARREN=${WARREN_BIN:-$TARGET/release/warren}
BENCH=${WARREN_BENCH:-$TARGET/release/warren-bench}
for bin in "$WARREN" "$BENCH"; do
    if [ ! -x "$bin" ]; then
        echo "$bin is missing: cargo build --release -p warren-server -p warren-bench" >&2
        exit 1
    fi
done
HTTP=$((PORT + 10000))
METRICS=$((PORT + 10100))
DATA=$(mktemp -d)
PID=""
finish() {
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    rm -rf "$DATA"
    return 0
}
trap finish EXIT

WARREN_COUNT_ALLOCATIONS=1 "$WARREN" --bind 127.0.0.1 --port "$PORT" --data-dir "$DATA/data" \
    --management-port "$HTTP" --prometheus-port "$METRICS" --no-sqs --log-level warn \
    >"$DATA/warren.log" 2>&1 &
PID=$!
for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$METRICS/metrics" >/dev/null 2>&1 && break
    sleep 0.1
done

# Allocations and bytes so far, as "COUNT BYTES".
totals() {
    curl -sf "http://127.0.0.1:$METRICS/metrics" | awk '
        /^warren_heap_allocations_total / { n = $2 }
        /^warren_heap_allocated_bytes_total / { b = $2 }
        END { if (n == "") { print "missing"; exit 1 } printf "%d %d\n", n, b }'
}
totals >/dev/null || { echo "the broker does not count allocations (is it older than this script?)" >&2; exit 1; }

read -r n0 b0 < <(totals)
sleep "$SECS"
read -r n1 b1 < <(totals)
idle_n=$(( (n1 - n0) ))
idle_b=$(( (b1 - b0) ))
echo "idle: $idle_n allocations, $idle_b bytes in ${SECS}s (one /metrics read included)"

URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
args() {
    case "$1" in
    s9) echo "-x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 --ack-wait" ;;
    s1) echo "--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --max-inflight 1000" ;;
    s2r) echo "--ack-batched -x 1 -y 1 --queues 1 -s 1024 --persistent --durable --confirm 1000 -q 200 --rate 5000" ;;
    s5) echo "--ack-batched -x 1 -y 1 --queues 1 -s 1024 -q 200 --rate 10000" ;;
    esac
}
printf '%-5s %12s %14s %14s\n' scenario messages "allocs/msg" "bytes/msg"
for s in s9 s1 s2r s5; do
    # shellcheck disable=SC2046
    "$BENCH" -u "$URL" $(args "$s") --queue-pattern "alloc-$s" -z 2 --quiet >/dev/null 2>&1
    read -r n0 b0 < <(totals)
    # shellcheck disable=SC2046
    out=$("$BENCH" -u "$URL" $(args "$s") --queue-pattern "alloc-$s" -z "$SECS" --json 2>/dev/null)
    read -r n1 b1 < <(totals)
    msgs=$(printf '%s' "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["consumed"])')
    awk -v n=$((n1 - n0 - idle_n)) -v b=$((b1 - b0 - idle_b)) -v m="$msgs" -v s="$s" \
        'BEGIN { printf "%-5s %12d %14.2f %14.1f\n", s, m, (m ? n / m : 0), (m ? b / m : 0) }'
done
echo "(the idle figures above are taken off each run's)"
