#!/usr/bin/env bash
# A quorum queue deeper than a gigabyte on a 3-node Warren cluster: is it snapshotted, and how does
# a member catch up with it? One follower is killed (SIGKILL), MESSAGES persistent 1 KiB messages
# are published with confirms into one quorum queue with no consumer through its leader's node,
# then the follower is started again: it has to be sent the whole queue. Prints each node's
# `raft/` folder (its log and its snapshots) after the backlog, how long the follower took to
# hold every message (its API's count of the queue) and its peak anonymous memory meanwhile
# (RssAnon, sampled every 50 ms), then the same for a restart of that follower on its own data.
#
#   bench/deep-snapshot.sh [--messages N] [--settle S]
#
# N defaults to 2,500,000 (a 2.5 GB queue: each node needs about three times that on disk, for its
# log, its snapshot and the contents it keeps out of memory). S (default 30) is how long to wait
# after the backlog for the members' snapshots to be written. Starts its own cluster
# (scripts/cluster, in a temporary folder) with WARREN_BIN, default the release build in
# CARGO_TARGET_DIR; warren-bench from WARREN_BENCH, default the release build.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MESSAGES=2500000
SETTLE=30
while [ $# -gt 0 ]; do
    case "$1" in
    --messages) MESSAGES=$2; shift ;;
    --settle) SETTLE=$2; shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
# shellcheck source=bench/warren-cluster.sh
. "$ROOT/bench/warren-cluster.sh"
rate() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]]))" "$1" "$2"; }
raft_mb() { # node N's raft/ folder, and the snapshots in it, in MB
    echo "$(du -sm "$WARREN_CLUSTER_DIR/node$1/raft" | cut -f1) MB ($(du -sm "$WARREN_CLUSTER_DIR/node$1/raft/snapshots" 2>/dev/null | cut -f1 || echo 0) MB of snapshots)"
}

# catch_up NODE: samples the node's RssAnon every 50 ms until its API counts MESSAGES in the queue
# (600 s at most); prints the time from the call and the peak.
catch_up() {
    python3 - "$WARREN_CLUSTER_DIR/node$1.pid" "$1" "$MESSAGES" <<'PY'
import base64, json, sys, time, urllib.request
pidfile, node, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
start, peak, pid, have, asked = time.time(), 0, None, None, 0.0
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
while time.time() - start < 600:
    try:
        pid = pid or open(pidfile).read().strip()
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                peak = max(peak, int(line.split()[1]) // 1024)
    except (OSError, ValueError):
        pid = None
    if time.time() - asked > 0.25:
        asked = time.time()
        try:
            req = urllib.request.Request(f"http://127.0.0.1:1570{node}/api/queues/%2f/deep",
                                         headers={"Authorization": auth})
            have = json.load(urllib.request.urlopen(req, timeout=1)).get("messages")
        except Exception:
            pass
        if have == want:
            print(f"{time.time() - start:.1f} s, peak RssAnon {peak} MB")
            sys.exit(0)
    time.sleep(0.05)
print(f"not caught up after 600 s (it counts {have}), peak RssAnon {peak} MB")
PY
}

leader=$(declare_quorum deep "")
follower=$(( leader % 3 + 1 ))
URL="amqp://guest:guest@127.0.0.1:570$leader/%2f"
"$ROOT/scripts/cluster" kill "$follower" >/dev/null
"$BENCH" -u "$URL" --json --quiet --label backlog --predeclare \
    -x 1 -y 0 --no-consume -s 1024 -f --durable -c 1000 -C "$MESSAGES" \
    --queue-pattern deep --queue-arg x-queue-type=quorum >"$WARREN_CLUSTER_DIR/backlog.json"
echo "backlog: $MESSAGES published through node $leader (the leader), node $follower down, at $(rate "$WARREN_CLUSTER_DIR/backlog.json" publish_rate) msg/s"
sleep "$SETTLE"
for n in 1 2 3; do
    [ "$n" = "$follower" ] || echo "node $n raft/ ${SETTLE} s after the backlog: $(raft_mb "$n")"
done
echo "RSS of the up nodes (MB, nodes 1 2 3; the one down left out):$(rss 2>/dev/null || true); RssAnon:$(rss RssAnon 2>/dev/null || true)"
"$ROOT/scripts/cluster" start "$follower" >/dev/null &
echo "node $follower started, holds every message after $(catch_up "$follower")"
wait
sleep 5
echo "node $follower raft/ after catching up: $(raft_mb "$follower")"
"$ROOT/scripts/cluster" kill "$follower" >/dev/null
"$ROOT/scripts/cluster" start "$follower" >/dev/null &
echo "node $follower restarted on its data, holds every message after $(catch_up "$follower")"
wait
echo "RSS (MB, nodes 1 2 3):$(rss); RssAnon:$(rss RssAnon) (VmRSS counts the pages of a snapshot file a node maps to send or read it)"
