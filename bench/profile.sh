#!/usr/bin/env bash
# Where the broker's CPU goes in one scenario: perf with call graphs on the release build, folded
# and drawn as a flame graph with inferno (from crates.io).
#
#   bench/profile.sh                       # the worker shape (s9: 16 B at 5,000 msg/s, each ack awaited)
#   bench/profile.sh --secs 20 --out bench/flamegraph-s9.svg
#   bench/profile.sh -- -x 1 -y 1 -s 1024 --rate 10000     # any warren-bench scenario after --
#
# It builds warren and warren-bench in release mode (debug info is on in that profile), installs
# inferno into $HOME/.cache/warren/tools if it is missing, starts Warren on 127.0.0.1:5690 with a
# fresh data directory, lets the scenario warm up for 2 s, records the broker for --secs seconds
# with `perf record --call-graph dwarf`, and writes the SVG (default bench/flamegraph.svg) and
# the folded stacks beside it (.folded), then prints the top frames. perf must be installed
# (Debian: linux-perf) and allowed to record (root, or kernel.perf_event_paranoid <= 1).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SECS=10
OUT="$ROOT/bench/flamegraph.svg"
PORT=5690
SCENARIO=(-x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000)
while [ $# -gt 0 ]; do
  case "$1" in
    --secs) SECS="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --port) PORT="$2"; shift ;;
    --) shift; SCENARIO=("$@"); break ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[profile] %s\n' "$*" >&2; }
command -v perf >/dev/null || { log "perf is not installed: apt-get install linux-perf"; exit 1; }

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
TOOLS="$HOME/.cache/warren/tools"
if [ ! -x "$TOOLS/bin/inferno-flamegraph" ]; then
  log "installing inferno into $TOOLS"
  cargo install inferno --root "$TOOLS" --locked -q
fi
log "building warren and warren-bench (release)"
(cd "$ROOT" && cargo build --release -q -p warren-server -p warren-bench)
WARREN="$CARGO_TARGET_DIR/release/warren"
BENCH="$CARGO_TARGET_DIR/release/warren-bench"

WORK="$(mktemp -d /tmp/warren-profile.XXXXXX)"
cleanup() {
  [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
"$WARREN" --port "$PORT" --data-dir "$WORK/data" --no-management --no-prometheus --bind 127.0.0.1 \
  >"$WORK/warren.log" 2>&1 &
PID=$!
for _ in $(seq 50); do (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.1; done
log "scenario: warren-bench ${SCENARIO[*]} (broker pid $PID)"
"$BENCH" --url "amqp://guest:guest@127.0.0.1:$PORT/%2f" --broker-pid "$PID" --json \
  "${SCENARIO[@]}" -z $((SECS + 4)) >"$WORK/bench.json" 2>/dev/null &
BENCH_PID=$!
sleep 2
log "recording $SECS s"
perf record -q -F 499 --call-graph dwarf,16384 -p "$PID" -o "$WORK/perf.data" -- sleep "$SECS" 2>/dev/null
wait "$BENCH_PID" || true
perf script -i "$WORK/perf.data" 2>/dev/null | "$TOOLS/bin/inferno-collapse-perf" >"${OUT%.svg}.folded"
"$TOOLS/bin/inferno-flamegraph" --title "warren: warren-bench ${SCENARIO[*]}" <"${OUT%.svg}.folded" >"$OUT"
log "flame graph: $OUT (folded stacks: ${OUT%.svg}.folded)"
python3 - "$WORK/bench.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
b = d.get("broker") or {}
print(f"[profile] broker CPU per message {b.get('cpu_us_per_msg')} us, consume rate {d.get('consume_rate')} msg/s")
EOF
perf report -i "$WORK/perf.data" --no-children --sort dso -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -6 >&2
