#!/usr/bin/env bash
# What TLS costs the broker per message: the same warren-bench scenario against the plain port
# and against amqps, broker CPU per message from --broker-pid.
#
# warren-bench's client is lapin, built without TLS in this workspace (its rustls feature pulls
# aws-lc), so the amqps runs go through socat, which does the client side of TLS in a process
# of its own: the broker's CPU (what is reported) is measured alone either way.
#
# Usage: bench/tls.sh [RUNS] [-- warren-bench scenario args, instead of the default]
#   WARREN=target/release/warren BENCH=target/release/warren-bench bench/tls.sh 3
# Needs openssl and socat. Default scenario: scenario 1 of compare.sh
# (--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 -z 20).
set -euo pipefail

RUNS=${1:-3}
shift || true
[[ ${1:-} == -- ]] && shift
EXTRA=("$@")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WARREN=${WARREN:-$ROOT/target/release/warren}
BENCH=${BENCH:-$ROOT/target/release/warren-bench}
for tool in openssl socat; do
  command -v "$tool" >/dev/null || { echo "bench/tls.sh needs $tool" >&2; exit 2; }
done

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# A throwaway CA and server certificate (ECDSA P-256, as most deployments use today).
cd "$WORK"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=bench CA" \
  -keyout ca.key -out ca.pem 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
  -keyout server.key -out server.csr 2>/dev/null
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
  -extfile server.ext -out server.pem 2>/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port); TLS_PORT=$(free_port); TUNNEL=$(free_port)
"$WARREN" --bind 127.0.0.1 --port "$PORT" --tls-port "$TLS_PORT" --tls-cert server.pem \
  --tls-key server.key --no-management --no-prometheus --data-dir "$WORK/data" --log-level warn \
  2> warren.log &
BROKER=$!
PIDS+=("$BROKER")
socat "TCP-LISTEN:$TUNNEL,bind=127.0.0.1,fork,reuseaddr" \
  "OPENSSL:127.0.0.1:$TLS_PORT,cafile=ca.pem,verify=1,nodelay" 2> socat.log &
PIDS+=("$!")
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done

SCENARIO=(--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 -z 20)
# EXTRA replaces the scenario when given.
[[ ${#EXTRA[@]} -gt 0 ]] && SCENARIO=("${EXTRA[@]}")
run() {
  local label=$1 port=$2 i
  for i in $(seq "$RUNS"); do
    "$BENCH" --url "amqp://guest:guest@127.0.0.1:$port/%2f" --broker-pid "$BROKER" \
      "${SCENARIO[@]}" --queue-pattern "tls-bench-$label-$i-%d" 2>&1 \
      | grep -E "published .*broker cpu" | sed "s/^/$label run $i: /" | tee -a results.txt
  done
}
echo "warren-bench ${SCENARIO[*]}, $RUNS runs each; broker $WARREN"
run plain "$PORT"
run tls "$TUNNEL"
awk '{ for (i = 1; i <= NF; i++) if ($i ~ /us\/msg$/) { v = $i; sub(/us\/msg/, "", v); sum[$1] += v; n[$1]++ } }
     END { for (k in sum) printf "%s: broker %.1f us/msg (mean of %d)\n", k, sum[k] / n[k], n[k] }' results.txt
