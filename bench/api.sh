#!/usr/bin/env bash
# Times the management API and the Prometheus endpoint of a broker holding many queues and
# connections (issue 10's bar: the first page of /api/queues under 100 ms and /metrics under
# 500 ms with 10,000 queues and 1,000 connections), on Warren or on RabbitMQ.
#
#   bench/api.sh                          # Warren (release build), 10,000 queues, 1,000 connections
#   bench/api.sh --rabbitmq               # the RabbitMQ on 127.0.0.1:5672 (management plugin on 15672)
#   bench/api.sh --queues 1000 --connections 100 --runs 3
#
# Needs pika (scripts/test installs it into clients/.deps/python) and curl. Prints a Markdown
# table: for each request, the median and the slowest of --runs answers, and the answer's size.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUEUES=10000
CONNECTIONS=1000
RUNS=5
TARGET=warren
BUILD=1
AMQP_PORT=5691
HTTP_PORT=15693
METRICS_PORT=15694
while [ $# -gt 0 ]; do
  case "$1" in
    --queues) QUEUES="$2"; shift ;;
    --connections) CONNECTIONS="$2"; shift ;;
    --runs) RUNS="$2"; shift ;;
    --rabbitmq) TARGET=rabbitmq ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option: $1 (see bench/api.sh --help)" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[api %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
export PYTHONPATH="$ROOT/clients/.deps/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import pika' 2>/dev/null ||
  { echo "pika is missing: run scripts/test once (it installs the test clients), or pip install pika" >&2; exit 1; }

WORK="$(mktemp -d)"
BROKER=""
FILLER=""
cleanup() {
  [ -n "$FILLER" ] && kill "$FILLER" 2>/dev/null && wait "$FILLER" 2>/dev/null
  [ -n "$BROKER" ] && kill "$BROKER" 2>/dev/null && wait "$BROKER" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$TARGET" = warren ]; then
  TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
  if [ "$BUILD" = 1 ]; then
    log "building warren (release)"
    cargo build --release -q -p warren-server
  fi
  log "starting Warren on 127.0.0.1:$AMQP_PORT (API $HTTP_PORT, metrics $METRICS_PORT)"
  "$TARGET_DIR/release/warren" --bind 127.0.0.1 --port "$AMQP_PORT" --data-dir "$WORK/data" \
    --management-port "$HTTP_PORT" --prometheus-port "$METRICS_PORT" --log-level warn \
    >"$WORK/warren.log" 2>&1 &
  BROKER=$!
  NAME="Warren $("$TARGET_DIR/release/warren" --version | awk '{print $2}') ($(git rev-parse --short HEAD))"
else
  AMQP_PORT=5672 HTTP_PORT=15672 METRICS_PORT=15692
  NAME="RabbitMQ $(rabbitmqctl -q version 2>/dev/null || echo '?')"
fi
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$AMQP_PORT") 2>/dev/null && break
  sleep 0.1
done

# Declares the queues (every other one durable, a 100-byte message in every third), opens the
# connections (one channel each), says "ready", holds them until killed, then deletes the queues.
log "declaring $QUEUES queues and opening $CONNECTIONS connections"
python3 - "$AMQP_PORT" "$QUEUES" "$CONNECTIONS" >"$WORK/filler.out" 2>"$WORK/filler.log" <<'EOF' &
import signal, sys, pika
port, nq, nc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
params = pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)
main = pika.BlockingConnection(params)
ch = main.channel()
names = [f"bench-api-{i:05d}" for i in range(nq)]
for i, q in enumerate(names):
    ch.queue_declare(q, durable=(i % 2 == 0))
    if i % 3 == 0:
        ch.basic_publish("", q, b"x" * 100)
held = []
for _ in range(nc):
    c = pika.BlockingConnection(params)
    c.channel()
    held.append(c)
print("ready", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    main.process_data_events(0.5)
for c in held:
    c.close()
for q in names:
    ch.queue_delete(q)
main.close()
EOF
FILLER=$!
while ! grep -q ready "$WORK/filler.out"; do
  kill -0 "$FILLER" 2>/dev/null || { cat "$WORK/filler.log" >&2; exit 1; }
  sleep 1
done

API="http://guest:guest@127.0.0.1:$HTTP_PORT"
MET="http://127.0.0.1:$METRICS_PORT"
echo "**$NAME**, $QUEUES queues, $CONNECTIONS connections, $RUNS answers per request ($(date -u +%Y-%m-%d))"
echo
echo "| request | median (ms) | slowest (ms) | size (KB) |"
echo "|---|---:|---:|---:|"
for u in "$API/api/queues?page=1&page_size=100" \
         "$API/api/queues?page=1&page_size=100&sort=messages&sort_reverse=true" \
         "$API/api/queues?page=1&page_size=100&sort=message_stats.publish_details.rate&sort_reverse=true" \
         "$API/api/queues?page=1&page_size=100&name=bench-api-01" \
         "$API/api/queues" \
         "$API/api/overview" \
         "$API/api/connections?page=1&page_size=100" \
         "$API/api/connections" \
         "$MET/metrics" \
         "$MET/metrics/per-object"; do
  times="$(for _ in $(seq 1 "$RUNS"); do
    curl -sf -o "$WORK/answer" -w '%{time_total}\n' "$u" || echo fail
  done | sort -n)"
  if grep -q fail <<<"$times"; then
    echo "| \`${u#*:[0-9][0-9][0-9][0-9][0-9]}\` | failed | | |"
    continue
  fi
  median="$(sed -n "$(((RUNS + 1) / 2))p" <<<"$times")"
  slowest="$(tail -1 <<<"$times")"
  kb=$(($(stat -c %s "$WORK/answer") / 1024))
  awk -v u="${u#*:[0-9][0-9][0-9][0-9][0-9]}" -v m="$median" -v s="$slowest" -v kb="$kb" \
    'BEGIN { printf "| `%s` | %.0f | %.0f | %s |\n", u, m * 1000, s * 1000, kb }'
done
