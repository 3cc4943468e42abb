#!/usr/bin/env bash
# Replicated queues beside RabbitMQ's quorum queues, on this machine: 1 KiB persistent messages with
# confirms into one quorum queue of a 3-node cluster, one publisher and one consumer, both connected
# to the queue's leader's node (Warren serves consumers there only; RabbitMQ gets the same shape).
# Runs RabbitMQ and Warren alternately, PAIRS times each, and prints warren-bench's figures.
#
#   bench/cluster.sh [--pairs N] [--secs S] [--worker] [--queues N]
#
# --worker: the consumer acks each message and waits for the ack's write before the next one (a
# pika or Celery worker); without it acks are batched (warren-bench --ack-batched).
# --queues N: N quorum queues (declared by warren-bench through node 1, where each broker places
# their leaders as it does by default), a publisher (confirm window 100) and a consumer for each,
# all connected to node 1; the CPU figure is node 1's alone.
# Needs: bench/rabbitmq-cluster.sh up (nodes on 5681-5683) and a Warren cluster from
# scripts/cluster up (5701-5703), with WARREN_BIN pointing at a release build for fair figures;
# warren-bench (WARREN_BENCH, default: the release build in CARGO_TARGET_DIR).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PAIRS=3
SECS=20
SHAPE="--ack-batched"
QUEUES=1
while [ $# -gt 0 ]; do
    case "$1" in
    --pairs) PAIRS=$2; shift ;;
    --secs) SECS=$2; shift ;;
    --worker) SHAPE="" ;;
    --queues)
        QUEUES=$2
        [[ $QUEUES =~ ^[1-9][0-9]*$ ]] || { echo "--queues takes a number of queues, not $QUEUES" >&2; exit 2; }
        shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
TARGET=${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}
BENCH=${WARREN_BENCH:-$TARGET/release/warren-bench}
[ -x "$BENCH" ] || { echo "no warren-bench at $BENCH: cargo build --release -p warren-bench, or set WARREN_BENCH" >&2; exit 1; }
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/clients/.deps/python"

# declare BROKER QUEUE: declares a quorum queue on node 1 and prints its leader's node number.
declare_and_find_leader() {
    local broker=$1 q=$2
    "$PY" - "$broker" "$q" <<'EOF'
import base64, json, sys, time, urllib.request
import pika
broker, q = sys.argv[1], sys.argv[2]
amqp, mgmt = (5700, 15700) if broker == "warren" else (5680, 15680)
c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp + 1))
c.channel().queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
c.close()
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
deadline = time.time() + 30
while time.time() < deadline:
    try:
        r = urllib.request.Request(f"http://127.0.0.1:{mgmt + 1}/api/queues/%2f/{q}", headers={"Authorization": auth})
        leader = json.load(urllib.request.urlopen(r, timeout=2)).get("leader")
        if leader:
            name = leader.split("@")[0]
            print(int(name.split("-")[1]) if broker == "warren" else int(name[2:]))
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.1)
sys.exit("no leader for " + q)
EOF
}

pid_of_node() {
    local broker=$1 n=$2
    if [ "$broker" = warren ]; then
        cat "${WARREN_CLUSTER_DIR:-$PWD/.warren-cluster}/node$n.pid"
    else
        cat "${RABBIT_CLUSTER_DIR:-/tmp/warren-rabbitmq-cluster}/rc$n/pid"
    fi
}

# run_many BROKER ROUND: QUEUES queues, a publisher and a consumer each, through node 1.
run_many() {
    local broker=$1 round=$2 port
    if [ "$broker" = warren ]; then port=5701; else port=5681; fi
    echo "== $broker, round $round: $QUEUES quorum queues through node 1"
    # shellcheck disable=SC2086
    "$BENCH" --url "amqp://guest:guest@127.0.0.1:$port/%2f" --queue-pattern "bench-qq-$broker-$round-$$-%d" \
        --queue-arg x-queue-type=quorum -x "$QUEUES" -y "$QUEUES" --queues "$QUEUES" -s 1024 --persistent \
        --durable --confirm 100 -q 200 --max-inflight 100 $SHAPE -z "$SECS" \
        --broker-pid "$(pid_of_node "$broker" 1)"
}

run() {
    local broker=$1 round=$2 q leader port
    if [ "$QUEUES" -gt 1 ]; then
        run_many "$broker" "$round"
        return
    fi
    q="bench-qq-$broker-$round-$$"
    leader=$(declare_and_find_leader "$broker" "$q")
    if [ "$broker" = warren ]; then port=$((5700 + leader)); else port=$((5680 + leader)); fi
    echo "== $broker, round $round: queue $q led by node $leader"
    # shellcheck disable=SC2086
    "$BENCH" --url "amqp://guest:guest@127.0.0.1:$port/%2f" --queue-pattern "$q" --predeclare --delete \
        -x 1 -y 1 --queues 1 -s 1024 --persistent --durable --confirm 1000 -q 200 \
        --max-inflight 1000 $SHAPE -z "$SECS" --broker-pid "$(pid_of_node "$broker" "$leader")"
}

for i in $(seq "$PAIRS"); do
    run rabbitmq "$i"
    run warren "$i"
done
