# shellcheck shell=bash
# Sourced by the benchmarks that start a 3-node Warren cluster of their own (scripts/cluster, in a
# temporary folder, ports 5701-5703): checks the binaries and the ports, starts the cluster, stops
# it and removes its folder on exit. Expects ROOT (the repository); sets WARREN_BIN, BENCH and
# WARREN_CLUSTER_DIR; defines rss, disk and declare_quorum.

TARGET=${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}
export WARREN_BIN=${WARREN_BIN:-$TARGET/release/warren}
BENCH=${WARREN_BENCH:-$TARGET/release/warren-bench}
for b in "$WARREN_BIN" "$BENCH"; do
    [ -x "$b" ] || { echo "no $b: cargo build --release -p warren-server -p warren-bench, or set WARREN_BIN and WARREN_BENCH" >&2; exit 1; }
done
for port in 5701 5702 5703; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "port $port is in use (a cluster from scripts/cluster up?): stop it first (scripts/cluster down)" >&2
        exit 1
    fi
done
WARREN_CLUSTER_DIR=$(mktemp -d)
export WARREN_CLUSTER_DIR
cleanup() {
    "$ROOT/scripts/cluster" down >/dev/null 2>&1 || true
    rm -rf "$WARREN_CLUSTER_DIR"
}
trap cleanup EXIT
"$ROOT/scripts/cluster" up >/dev/null

rss() { # the three nodes' VmRSS (or, given VmHWM, their peak) in MB
    local out="" n field=${1:-VmRSS}
    for n in 1 2 3; do
        out="$out $(awk -v f="^$field" '$0 ~ f {printf "%.0f", $2 / 1024}' "/proc/$(cat "$WARREN_CLUSTER_DIR/node$n.pid")/status")"
    done
    echo "$out"
}

disk() { # the three nodes' data directories, in MB
    local out="" n
    for n in 1 2 3; do
        out="$out $(du -sm "$WARREN_CLUSTER_DIR/node$n" 2>/dev/null | cut -f1)"
    done
    echo "$out"
}

# declare_quorum NAME ARGUMENTS-JSON: declares a quorum queue through node 1's API and prints the
# number of the node that leads it.
declare_quorum() {
    local name=$1 args=$2 leader=""
    curl -sf -u guest:guest -X PUT -H 'content-type: application/json' \
        -d "{\"durable\":true,\"arguments\":{\"x-queue-type\":\"quorum\"$args}}" \
        "http://127.0.0.1:15701/api/queues/%2f/$name" >/dev/null
    for _ in $(seq 1 100); do
        leader=$(curl -s -u guest:guest "http://127.0.0.1:15701/api/queues/%2f/$name" |
            python3 -c "import json,sys; print(json.load(sys.stdin)['leader'].split('@')[0].split('-')[1])" 2>/dev/null) && break
        sleep 0.1
    done
    [ -n "$leader" ] || { echo "the queue $name has no leader" >&2; exit 1; }
    echo "$leader"
}
