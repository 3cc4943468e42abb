#!/usr/bin/env bash
# Deep queues, start-up and flow control, measured on a release build of Warren:
#   1. shallow   persistent 1 KiB messages with confirms while a consumer keeps the queue short
#                (the rate a deep queue's drain is compared with)
#   2. backlog   MESSAGES persistent 1 KiB messages into one durable queue with no consumer;
#                the broker's memory afterwards
#   3. restart   a clean stop and start with the backlog on disk: recovery time and memory
#   4. drain     the backlog consumed with acks (prefetch 200): rate and memory
#   5. many      QUEUES durable queues filled round-robin with PER_QUEUE messages each, then
#                kill -9 and start: recovery time and memory
#   6. alarm     a publisher against --memory-limit set below the broker's memory: publishing is
#                blocked (connection.blocked) while a consumer keeps draining
# Results go to bench/results/deep-<time>/ (summary.md, one JSON per run, the broker logs).
#
# Usage: bench/deep-queue.sh [--messages N] [--queues Q] [--per-queue M] [--port P] [--steps LIST]
# Defaults: 10,000,000 messages; 10,000 queues x 1,000 messages; port 5699; steps
# shallow,backlog,restart,drain,many,alarm. Needs ~25 GB of free disk for the default sizes.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
MESSAGES=10000000
QUEUES=10000
PER_QUEUE=1000
PORT=5699
STEPS="shallow,backlog,restart,drain,many,alarm"
while [ $# -gt 0 ]; do
  case "$1" in
    --messages) MESSAGES="$2"; shift ;;
    --queues) QUEUES="$2"; shift ;;
    --per-queue) PER_QUEUE="$2"; shift ;;
    --port) PORT="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
# shellcheck source=../scripts/lib/build-deps.sh
. "$ROOT/scripts/lib/build-deps.sh"
install_build_deps >&2
cargo build --release -q -p warren-server -p warren-bench
WARREN="$CARGO_TARGET_DIR/release/warren"
BENCH="$CARGO_TARGET_DIR/release/warren-bench"
URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
OUT="$ROOT/bench/results/deep-$(date -u +%Y%m%dT%H%M%SZ)"
DATA="$OUT/data"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
PID=""

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
rss_mb() { awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
hwm_mb() { awk '/^VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

start() {
  local name="$1"
  shift
  "$WARREN" --bind 127.0.0.1 --port "$PORT" --data-dir "$DATA" --log-level info "$@" \
    >"$OUT/$name.log" 2>&1 &
  PID=$!
  # The listener is bound before recovery; the log says when recovery is over.
  for _ in $(seq 1 6000); do
    if grep -q "recovered durable state" "$OUT/$name.log"; then return 0; fi
    if ! kill -0 "$PID" 2>/dev/null; then
      echo "warren exited while starting: see $OUT/$name.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "warren did not finish recovering within 10 minutes: see $OUT/$name.log" >&2
  exit 1
}

stop() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
}

# Start-up time: the definitions, then the queues' messages (logged separately).
recovery_ms() {
  sed -n 's/.*\(definitions recovered\|recovered durable state\).* ms=\([0-9]*\).*/\2/p' "$OUT/$1.log" |
    awk '{ total += $1 } END { print total }'
}

bench() {
  local name="$1"
  shift
  log "$name: warren-bench $*"
  "$BENCH" -u "$URL" --broker-pid "$PID" --json --quiet --label "$name" "$@" >"$OUT/$name.json"
}

# field RUN KEY: a number from a run's JSON report, rounded.
field() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]]))" "$OUT/$1.json" "$2"; }

trap stop EXIT
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

{
  echo "# Deep queues, start-up and flow control ($(date -u +%Y-%m-%d))"
  echo
  echo "\`bench/deep-queue.sh --messages $MESSAGES --queues $QUEUES --per-queue $PER_QUEUE\`, release build,"
  echo "$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM. Persistent 1 KiB messages, durable queues."
  echo
  echo "| step | what | figure |"
  echo "|---|---|---|"
} >"$SUMMARY"
row() { echo "| $1 | $2 | $3 |" >>"$SUMMARY"; }

rm -rf "$DATA"
start first
if has shallow; then
  bench shallow --ack-batched -x 1 -y 1 -s 1024 -f --durable -c 1000 -q 200 --max-inflight 2000 -C 1000000 \
    --queue-pattern shallow
  row shallow "publish + consume, queue kept short (1M messages)" \
    "$(field shallow consume_rate) msg/s consumed"
fi
if has backlog; then
  bench backlog -x 1 -y 0 --no-consume -s 1024 -f --durable -c 1000 -C "$MESSAGES" \
    --queue-pattern deep
  row backlog "publish $MESSAGES into one queue, no consumer" \
    "$(field backlog publish_rate) msg/s; RSS $(rss_mb "$PID") MB after, peak $(hwm_mb "$PID") MB"
  du -sh "$DATA" | awk '{print $1}' >"$OUT/backlog-disk.txt"
fi
if has restart; then
  stop
  start restart
  row restart "clean restart with the backlog on disk" \
    "recovered in $(recovery_ms restart) ms; RSS $(rss_mb "$PID") MB"
fi
if has drain; then
  bench drain --ack-batched -x 0 -y 1 --predeclare --delete --no-reset-peak -q 200 -C "$MESSAGES" \
    --queue-pattern deep
  row drain "consume the backlog with acks (prefetch 200)" \
    "$(field drain consume_rate) msg/s; RSS $(rss_mb "$PID") MB after, peak $(hwm_mb "$PID") MB"
fi
if has many; then
  bench many -x 4 -y 0 --no-consume --spread --queues "$QUEUES" -s 1024 -f --durable -c 1000 \
    -C $((QUEUES * PER_QUEUE)) --queue-pattern "many-%d"
  row many "publish $PER_QUEUE into each of $QUEUES queues" \
    "$(field many publish_rate) msg/s; RSS $(rss_mb "$PID") MB after"
  kill -9 "$PID"
  wait "$PID" 2>/dev/null || true
  start many-restart
  row many "kill -9, start with $QUEUES queues and $((QUEUES * PER_QUEUE)) messages" \
    "recovered in $(recovery_ms many-restart) ms; RSS $(rss_mb "$PID") MB"
fi
if has alarm; then
  bench alarm-backlog -x 1 -y 0 --no-consume -s 1024 -f --durable -c 1000 -C 100000 \
    --queue-pattern alarm
  stop
  # A limit below any broker's memory: the alarm is on from the first check.
  start alarm --memory-limit 1
  sleep 2
  bench alarm --ack-batched -x 1 -y 1 --predeclare --delete -s 1024 -f -q 200 -z 5 --queue-pattern alarm
  row alarm "memory alarm on (--memory-limit 1): a publisher and a consumer of a 100,000-message queue, 5 s" \
    "published $(field alarm published), consumed $(field alarm consumed)"
fi
stop
trap - EXIT
rm -rf "$DATA"
# The summary docs/benchmarks.md includes (bench/report.py); results/ itself is not committed.
cp "$SUMMARY" "$ROOT/bench/deep-queue.md"
cat "$SUMMARY"
