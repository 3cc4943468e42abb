#!/usr/bin/env bash
# A node catching up a deep quorum queue from its leader's snapshot, while another queue's
# publisher needs that node's vote: how long the node's Raft thread stops (its longest pass) and
# how long the publisher waits for a confirm meanwhile.
#
#   bench/catch-up.sh [--messages N] [--runs R]
#
# A fresh local cluster under $WARREN_CLUSTER_DIR (default: a temporary folder, removed at the
# end): quorum queues `busy` and `deep` declared on node 1; node 3 killed; N (default 600,000)
# persistent 1 KiB messages published into `deep` with confirms (a snapshot of about N KB is
# taken meanwhile); node 2 killed, node 3 started, and, once `busy` has a leader again, a publisher
# sends 500 msg/s to `busy` with confirms for 25 s. Every queue then has nodes 1 and 3 only: each confirm waits for node 3, which
# is installing `deep`'s snapshot. Prints the publisher's figures of each second and its summary, node 3's Raft passes of 50 ms
# or more (logged at debug level), and node 3's peak memory while it catches up: its anonymous
# memory (RssAnon, sampled every 50 ms: what the kernel cannot take back) and its peak RSS
# (VmHWM, which also counts the page cache's pages it maps).
#
# Needs: a release build (WARREN_BIN, default the release `warren` in CARGO_TARGET_DIR, and
# WARREN_BENCH likewise); about 3 GB of memory per 600,000 messages (three nodes).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MESSAGES=600000
RUNS=1
while [ $# -gt 0 ]; do
    case "$1" in
    --messages) MESSAGES=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    *) echo "unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
    shift
done
TARGET=${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}
export WARREN_BIN=${WARREN_BIN:-$TARGET/release/warren}
BENCH=${WARREN_BENCH:-$TARGET/release/warren-bench}
for bin in "$WARREN_BIN" "$BENCH"; do
    if [ ! -x "$bin" ]; then
        echo "$bin is missing: cargo build --release -p warren-server -p warren-bench" >&2
        exit 1
    fi
done
OWN_DIR=""
if [ -z "${WARREN_CLUSTER_DIR:-}" ]; then
    OWN_DIR=$(mktemp -d)
    export WARREN_CLUSTER_DIR=$OWN_DIR
fi
export WARREN_LOG="info,warren::cluster::node=debug"
CLUSTER="$ROOT/scripts/cluster"
U=amqp://guest:guest@127.0.0.1
QQ=(--queue-arg x-queue-type=quorum --durable -f --no-consume --keep -x 1 -y 0)

finish() {
    "$CLUSTER" down >/dev/null 2>&1 || true
    [ -n "$OWN_DIR" ] && rm -rf "$OWN_DIR"
    return 0
}
trap finish EXIT

for run in $(seq 1 "$RUNS"); do
    rm -rf "${WARREN_CLUSTER_DIR:?}"/*
    "$CLUSTER" up >/dev/null
    "$BENCH" -u "$U:5701/%2f" "${QQ[@]}" --queue-pattern busy -s 16 -c 10 --count 10 --quiet >/dev/null
    "$CLUSTER" kill 3 >/dev/null
    "$BENCH" -u "$U:5701/%2f" "${QQ[@]}" --queue-pattern deep -s 1024 -c 500 --count "$MESSAGES" \
        --quiet >/dev/null
    # The last snapshot of `deep` written on nodes 1 and 2.
    sleep 8
    "$CLUSTER" kill 2 >/dev/null
    "$CLUSTER" start 3 >/dev/null &
    python3 - "$WARREN_CLUSTER_DIR/node3.pid" >"$WARREN_CLUSTER_DIR/node3.anon" <<'PY' &
import sys, time
end, peak, pid = time.time() + 27, 0, None
while time.time() < end:
    try:
        pid = pid or open(sys.argv[1]).read().strip()
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                peak = max(peak, int(line.split()[1]) // 1024)
    except (OSError, ValueError):
        pid = None
    time.sleep(0.05)
print(peak)
PY
    # The publisher starts once `busy` has a leader again (nodes 1 and 3 elect one once node 3
    # is up), so that its confirms measure the catch-up, not the election after two nodes went.
    started=$(date +%s.%N)
    for _ in $(seq 1 600); do
        leader=$(curl -s -m 1 -u guest:guest "http://127.0.0.1:15701/api/queues/%2f/busy" |
            python3 -c 'import json, sys; print(json.load(sys.stdin).get("leader") or "")' 2>/dev/null || true)
        [ -n "$leader" ] && break
        sleep 0.05
    done
    echo "run $run: busy led by ${leader:-nobody} $(python3 -c "import time; print(f'{time.time() - $started:.2f}')") s after node 3's start began"
    echo "run $run: publisher to busy (500 msg/s, confirms) while node 3 catches up $MESSAGES messages"
    # Each second's figures, then the summary: a stall shows as the seconds it lasted.
    "$BENCH" -u "$U:5701/%2f" "${QQ[@]}" --queue-pattern busy -s 16 -c 50 -r 500 -z 25 2>&1 | grep -E '^ *[0-9.]+s[: ]'
    wait
    echo "node 3: peak RssAnon $(cat "$WARREN_CLUSTER_DIR/node3.anon") MB (sampled), VmHWM $(awk '/^VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$(cat "$WARREN_CLUSTER_DIR/node3.pid")/status") MB"
    grep -h "slow raft pass\|restored from a snapshot" "$WARREN_CLUSTER_DIR"/node3.log || true
    "$CLUSTER" down >/dev/null
done
