#!/usr/bin/env bash
# A deep quorum queue on a 3-node Warren cluster: MESSAGES persistent 1 KiB messages published
# with confirms into one quorum queue with no consumer, then drained with acks (prefetch 200),
# both through the queue's leader's node. Prints each node's RSS (VmRSS) before, after the
# backlog and after the drain, its peak RSS (VmHWM: snapshots taken meanwhile included), the
# messages whose contents each node keeps out of memory, and the rates. With --restart, a
# follower is killed (SIGKILL) after the backlog and started again on its data: its RSS and its
# anonymous memory (RssAnon: what the kernel cannot take back, unlike the page cache's pages
# of a mapped file) are sampled every 50 ms from its start, their peaks and its RSS 6 s after
# it are printed, with the time until its API answers. With --ttl MS, the queue has
# x-message-ttl MS (every message carries an expiry; MS long enough that none expires). With
# --groups G, the queue has x-group-header x-group-id and the messages are in G groups, in turn.
#
#   bench/deep-cluster.sh [--messages N] [--restart] [--ttl MS] [--groups G]
#
# Starts its own cluster (scripts/cluster, in a temporary folder) with WARREN_BIN, default the
# release build in CARGO_TARGET_DIR; warren-bench from WARREN_BENCH, default the release build.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MESSAGES=300000
RESTART=""
TTL=""
GROUP_COUNT=0
while [ $# -gt 0 ]; do
    case "$1" in
    --messages) MESSAGES=$2; shift ;;
    --restart) RESTART=1 ;;
    --ttl)
        TTL=$2
        [[ $TTL =~ ^[0-9]+$ ]] || { echo "--ttl takes milliseconds, not $TTL" >&2; exit 2; }
        shift ;;
    --groups)
        GROUP_COUNT=$2
        [[ $GROUP_COUNT =~ ^[0-9]+$ ]] || { echo "--groups takes a number of groups, not $GROUP_COUNT" >&2; exit 2; }
        shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
# Each member keeps the messages' contents (in its log, then in away/ files and snapshots): about
# 1.7 KB a message per member after the backlog and up to 2.3 KB before its log is compacted (the
# runs in docs/benchmarks.md); 2.5 KB leaves some room.
need=$(( MESSAGES * 3 * 2500 / 1024 / 1024 ))
free=$(df -Pm "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}')
if [ "$free" -lt "$need" ]; then
    echo "$MESSAGES messages need about $need MB on ${TMPDIR:-/tmp} for three members; $free MB are free" >&2
    echo "(set TMPDIR to a folder on a larger disk, or pass fewer --messages)" >&2
    exit 1
fi
# shellcheck source=bench/warren-cluster.sh
. "$ROOT/bench/warren-cluster.sh"
rate() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]]))" "$1" "$2"; }

echo "RSS before (MB, nodes 1 2 3):$(rss)"
TTL_JSON=""
TTL_ARG=()
if [ -n "$TTL" ]; then
    TTL_JSON=",\"x-message-ttl\":$TTL"
    TTL_ARG=(--queue-arg "x-message-ttl=$TTL")
fi
if [ "$GROUP_COUNT" -gt 0 ]; then
    TTL_JSON="$TTL_JSON,\"x-group-header\":\"x-group-id\""
    TTL_ARG+=(--queue-arg "x-group-header=x-group-id" --groups "$GROUP_COUNT")
fi
leader=$(declare_quorum deep "$TTL_JSON")
URL="amqp://guest:guest@127.0.0.1:570$leader/%2f"
"$BENCH" -u "$URL" --json --quiet --label backlog --predeclare \
    -x 1 -y 0 --no-consume -s 1024 -f --durable -c 1000 -C "$MESSAGES" \
    --queue-pattern deep --queue-arg x-queue-type=quorum "${TTL_ARG[@]}" >"$WARREN_CLUSTER_DIR/backlog.json"
sleep 3
away=""
for n in 1 2 3; do
    away="$away $(curl -s "http://127.0.0.1:1579$n/metrics" | awk '/^warren_replicated_messages_away/ {print $2}')"
done
echo "backlog: $MESSAGES published through node $leader (the leader) at $(rate "$WARREN_CLUSTER_DIR/backlog.json" publish_rate) msg/s"
echo "RSS after the backlog (MB):$(rss)"
echo "data directories after the backlog (MB):$(disk)"
echo "peak RSS so far (MB):$(rss VmHWM)"
echo "messages whose contents are out of memory:${away:- (none reported)}"
if [ -n "$RESTART" ]; then
    follower=$(( leader % 3 + 1 ))
    "$ROOT/scripts/cluster" kill "$follower" >/dev/null
    "$ROOT/scripts/cluster" start "$follower" >/dev/null &
    starting=$!
    started=$(date +%s.%N)
    pid=""
    for _ in $(seq 1 200); do
        pid=$(cat "$WARREN_CLUSTER_DIR/node$follower.pid" 2>/dev/null) &&
            [ -d "/proc/$pid" ] && kill -0 "$pid" 2>/dev/null && break
        sleep 0.01
    done
    # Peaks of VmRSS and RssAnon sampled every 50 ms for 8 s; the API's first answer.
    python3 - "$pid" "$follower" "$started" <<'PY'
import sys, time, urllib.error, urllib.request
pid, node, started = sys.argv[1], sys.argv[2], float(sys.argv[3])
peak = {"VmRSS": 0, "RssAnon": 0}
serving = None
end = time.time() + 8
while time.time() < end:
    try:
        for line in open(f"/proc/{pid}/status"):
            k, _, v = line.partition(":")
            if k in peak:
                peak[k] = max(peak[k], int(v.split()[0]) // 1024)
    except OSError:
        break
    if serving is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:1570{node}/api/overview", timeout=0.2)
            serving = time.time() - started
        except urllib.error.HTTPError:
            serving = time.time() - started  # 401: it answers
        except Exception:
            pass
    time.sleep(0.05)
now = {k: int(l.split(":")[1].split()[0]) // 1024 for l in open(f"/proc/{pid}/status")
       for k in ("VmRSS", "RssAnon", "VmHWM") if l.startswith(k + ":")}
print(f"restart of node {node}: peak sampled VmRSS {peak['VmRSS']} MB, RssAnon {peak['RssAnon']} MB; "
      f"VmHWM {now['VmHWM']} MB; 8 s after its start VmRSS {now['VmRSS']} MB, RssAnon {now['RssAnon']} MB; "
      f"API answering after {serving:.1f} s" if serving is not None else "API not answering after 8 s")
PY
    wait "$starting" || true
    echo "messages away on node $follower: $(curl -s "http://127.0.0.1:1579$follower/metrics" | awk '/^warren_replicated_messages_away/ {print $2}')"
fi
"$BENCH" -u "$URL" --json --quiet --label drain \
    --ack-batched -x 0 -y 1 --predeclare -q 200 -C "$MESSAGES" \
    --queue-pattern deep --queue-arg x-queue-type=quorum "${TTL_ARG[@]}" >"$WARREN_CLUSTER_DIR/drain.json"
echo "drain: $(rate "$WARREN_CLUSTER_DIR/drain.json" consume_rate) msg/s"
sleep 3
echo "RSS after the drain (MB):$(rss)"
echo "peak RSS (MB):$(rss VmHWM)"
