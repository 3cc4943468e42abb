#!/usr/bin/env bash
# Memory of a quorum queue's messages that wait beside its line, on a 3-node Warren cluster it
# starts (scripts/cluster, a temporary folder, ports 5701-5703):
#
#   bench/quorum-waiting.sh held N    N persistent 1 KiB publishes with confirms into a queue with
#                                     x-delivery-delay 600000 (held in its log until due)
#   bench/quorum-waiting.sh retry N   N of them into a queue with x-delayed-retry-min 600000, each
#                                     nacked with requeue by a worker (pika, prefetch 200) as it
#                                     arrives: every one waits for its retry
#   bench/quorum-waiting.sh inflight N
#                                     N of them into a plain quorum queue, taken by a worker (pika,
#                                     no prefetch limit) that holds every one unacked until the
#                                     RSS is read
#
# Prints each node's RSS before and 4 s after, and how many messages each keeps out of memory.
# WARREN_BIN: the warren binary (default: the release build in CARGO_TARGET_DIR); the retry
# shape needs pika, which scripts/test installs into clients/.deps/python.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHAPE=${1:-}
N=${2:-}
case "$SHAPE" in
held | retry | inflight) ;;
*) echo "usage: bench/quorum-waiting.sh held|retry|inflight N" >&2; exit 2 ;;
esac
[[ "$N" =~ ^[0-9]+$ ]] || { echo "usage: bench/quorum-waiting.sh held|retry|inflight N (a count)" >&2; exit 2; }
if [ "$SHAPE" != held ] && ! PYTHONPATH="$ROOT/clients/.deps/python" python3 -c "import pika" 2>/dev/null; then
    echo "the $SHAPE shape needs pika in clients/.deps/python: run scripts/test once (it installs it)" >&2
    exit 1
fi
# shellcheck source=bench/warren-cluster.sh
. "$ROOT/bench/warren-cluster.sh"

case "$SHAPE" in
held) ARG=',"x-delivery-delay":600000' ;;
retry) ARG=',"x-delayed-retry-min":600000' ;;
inflight) ARG='' ;;
esac
leader=$(declare_quorum waiting "$ARG")
echo "RSS before (MB, nodes 1 2 3):$(rss); the queue's leader: node $leader"
if [ "$SHAPE" = held ]; then
    "$BENCH" -u "amqp://guest:guest@127.0.0.1:570$leader/%2f" --quiet --predeclare -x 1 -y 0 \
        --no-consume -s 1024 -f --durable -c 500 -C "$N" --queue-pattern waiting \
        --queue-arg x-queue-type=quorum --queue-arg x-delivery-delay=600000 2>&1 | tail -1
else
    # A pika worker on the leader's node that publishes N and takes what comes: `retry` nacks
    # each with requeue (prefetch 200) and goes once it failed all; `inflight` holds them all
    # unacked (no prefetch limit), says so in the file given, and goes when its stdin closes.
    WORKER_PY='
import sys, time, pika
shape, port, n, flag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
ch = conn.channel()
ch.confirm_delivery()
seen = 0
def take(channel, method, _props, _body):
    global seen
    if shape == "retry":
        channel.basic_nack(method.delivery_tag, requeue=True)
    seen += 1
ch.basic_qos(prefetch_count=200 if shape == "retry" else 0)
ch.basic_consume("waiting", take)
start = time.time()
for i in range(n):
    ch.basic_publish("", "waiting", b"x" * 1020 + b"%04d" % (i % 10000),
                     pika.BasicProperties(delivery_mode=2))
    if i % 100 == 99:
        conn.process_data_events(0)
while seen < n and time.time() - start < 300:
    conn.process_data_events(0.1)
what = "nacked" if shape == "retry" else "holds unacked"
print(f"published {n}, {what} {seen} after {time.time() - start:.1f} s", flush=True)
if shape == "inflight":
    open(flag, "w").close()
    sys.stdin.read()
conn.close()
'
    ARGS=("$SHAPE" "570$leader" "$N" "$WARREN_CLUSTER_DIR/held")
    if [ "$SHAPE" = retry ]; then
        PYTHONPATH="$ROOT/clients/.deps/python" python3 -c "$WORKER_PY" "${ARGS[@]}" </dev/null
    else
        exec 3> >(PYTHONPATH="$ROOT/clients/.deps/python" python3 -c "$WORKER_PY" "${ARGS[@]}")
        WORKER=$!
        for _ in $(seq 3000); do [ -e "$WARREN_CLUSTER_DIR/held" ] && break; sleep 0.1; done
    fi
fi
sleep 4
echo "RSS after (MB):$(rss)"
away=""
for n in 1 2 3; do
    away="$away $(curl -s "http://127.0.0.1:1579$n/metrics" | awk '/^warren_replicated_messages_away/ {print $2}')"
done
echo "messages whose contents are out of memory:$away"
if [ "$SHAPE" = inflight ]; then
    exec 3>&-
    wait "$WORKER" 2>/dev/null || true
fi
