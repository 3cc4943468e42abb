#!/usr/bin/env bash
# The SQS API under load (warren-sqs-bench), on a release build of Warren alone with a fresh data
# directory. ElasticMQ is not packaged in the registries this machine reaches (it is a JVM jar),
# so docs/benchmarks.md sets these figures beside the ones ElasticMQ publishes.
#   single     one client sending (SendMessage, 16 B) for SECS s, then receiving and deleting
#              them (batches of 10): rate and broker CPU per message
#   elasticmq  ElasticMQ's published shape: 20, then 40 threads each sending, receiving and
#              deleting one message at a time
#   pollers    32 long-pollers (WaitTimeSeconds 1, up to 10 a receive, batch deletes) fed by 4
#              threads of SendMessageBatch
#   wakeup     a waiting long poll (WaitTimeSeconds 20) answered once a message is sent: from the
#              send's start and from its answer, p50/p99
#   idle       IDLE long-pollers waiting on empty queues: broker RSS per poller, CPU while idle
# Every message is durable (Warren's SQS queues are): a send is answered once it is on disk.
#
# Usage: bench/sqs.sh [--secs S] [--idle N] [--scenarios LIST] [--port P]
# Defaults: 10 s per timed scenario, 1,000 idle pollers, every scenario, SQS port 9424 (AMQP
# 5694, management 15694, metrics 15695). Prints the JSON report; progress lines on stderr.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECS=10
IDLE=1000
SCENARIOS="single,elasticmq,pollers,wakeup,idle"
PORT=9424
while [ $# -gt 0 ]; do
  case "$1" in
    --secs) SECS="$2"; shift ;;
    --idle) IDLE="$2"; shift ;;
    --scenarios) SCENARIOS="$2"; shift ;;
    --port) PORT="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
# shellcheck source=../scripts/lib/build-deps.sh
. "$ROOT/scripts/lib/build-deps.sh"
install_build_deps >&2
cargo build --release -p warren-server -p warren-bench >&2
WARREN="$CARGO_TARGET_DIR/release/warren"
BENCH="$CARGO_TARGET_DIR/release/warren-sqs-bench"

# Each idle poller holds a connection; the bench and the broker need that many descriptors.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

DATA=$(mktemp -d)
"$WARREN" --data-dir "$DATA" --port 5694 --management-port 15694 --prometheus-port 15695 \
  --sqs-port "$PORT" --log-level warn >"$DATA.log" 2>&1 &
PID=$!
cleanup() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; rm -rf "$DATA" "$DATA.log"; }
trap cleanup EXIT
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done
echo "warren $(git rev-parse --short HEAD 2>/dev/null || echo '?') (release), pid $PID, $(nproc) cores" >&2
"$BENCH" --endpoint "http://127.0.0.1:$PORT" --broker-pid "$PID" --secs "$SECS" \
  --idle-pollers "$IDLE" --scenarios "$SCENARIOS"
