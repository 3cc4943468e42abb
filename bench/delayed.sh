#!/usr/bin/env bash
# Delayed messages (an x-delayed-message exchange, x-delay headers), measured on a release build
# of Warren alone: the Debian RabbitMQ 3.10.8 of this machine has no delayed-message plugin.
#   1. lateness  RATE msg/s for DURATION s with an x-delay of DELAY ms (persistent, confirms),
#                consumed with acks: lateness = receive time - due time (p50/p90/p99/p99.9/max),
#                early deliveries and lost messages (both must be 0); nothing else scheduled
#   2. schedule  MESSAGES persistent messages with confirms to a durable x-delayed-message
#                exchange, x-delay uniformly random in 1-2 hours (none falls due during the
#                run): publish rate, RSS after publishing and after a 10 s pause, disk use;
#                then step 1 again while they are scheduled (the realistic shape)
#   3. restart   a clean stop and start with them on disk: start-up time, RSS; then step 1 again
# The issue's targets: 10,000,000 scheduled with RSS under 300 MB; p99 lateness under 50 ms at
# 10,000 msg/s falling due. Results go to bench/results/delayed-<time>/ (summary.md, one JSON per
# run and its progress lines, the broker logs, load.txt); the data directory is deleted at the end.
#
# Usage: bench/delayed.sh [--messages N] [--rate R] [--duration S] [--delay MS] [--size B]
#                         [--port P] [--steps LIST] [--clean-build]
# Defaults: 10,000,000 messages of 1 KiB; 10,000 msg/s for 60 s with a 2,000 ms delay; port 5698;
# steps lateness,schedule,restart. --clean-build builds the broker from a clean export of HEAD
# (uncommitted broker work in the tree is not measured; warren-bench comes from the tree).
# The full run takes about 10 minutes and up to about 1 GB of disk (the bench's bodies compress well).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
MESSAGES=10000000
RATE=10000
DURATION=60
DELAY=2000
SIZE=1024
PORT=5698
STEPS="lateness,schedule,restart"
CLEAN_BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --messages) MESSAGES="$2"; shift ;;
    --rate) RATE="$2"; shift ;;
    --duration) DURATION="$2"; shift ;;
    --delay) DELAY="$2"; shift ;;
    --size) SIZE="$2"; shift ;;
    --port) PORT="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --clean-build) CLEAN_BUILD=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
# shellcheck source=../scripts/lib/build-deps.sh
. "$ROOT/scripts/lib/build-deps.sh"
install_build_deps >&2
OUT="$ROOT/bench/results/delayed-$(date -u +%Y%m%dT%H%M%SZ)"
DATA="$OUT/data"
mkdir -p "$OUT/bin"
REV="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$CLEAN_BUILD" = 1 ]; then
  log "building warren (release) from a clean export of HEAD ($REV)"
  SRC="$(mktemp -d)"
  # -m: files dated now, not at the commit: cargo compares mtimes, and a commit older than the
  # last build of the tree would otherwise reuse that build (uncommitted work included).
  git archive HEAD | tar -x -m -C "$SRC"
  (cd "$SRC" && cargo build --release -q -p warren-server)
  rm -rf "$SRC"
  cp "$CARGO_TARGET_DIR/release/warren" "$OUT/bin/"
  REV="$REV (clean build of HEAD)"
  log "building warren-bench (release) from the tree"
  cargo build --release -q -p warren-bench
else
  log "building warren and warren-bench (release)"
  cargo build --release -q -p warren-server -p warren-bench
  cp "$CARGO_TARGET_DIR/release/warren" "$OUT/bin/"
  if [ -n "$(git status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null)" ]; then
    REV="$REV (with uncommitted changes)"
  fi
fi
# Private copies: a rebuild in the shared target directory during the run changes nothing.
cp "$CARGO_TARGET_DIR/release/warren-bench" "$OUT/bin/"
WARREN="$OUT/bin/warren"
BENCH="$OUT/bin/warren-bench"
URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
SUMMARY="$OUT/summary.md"
PID=""

rss_mb() { awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

# start NAME: starts the broker and waits for the end of recovery; sets PID and START_MS.
start() {
  local name="$1" t0
  shift
  t0=$(date +%s%N)
  "$WARREN" --bind 127.0.0.1 --port "$PORT" --data-dir "$DATA" --log-level info "$@" \
    >"$OUT/$name.log" 2>&1 &
  PID=$!
  # The listener is bound before recovery; the log says when recovery is over.
  for _ in $(seq 1 30000); do
    if grep -q "recovered durable state" "$OUT/$name.log"; then
      START_MS=$((($(date +%s%N) - t0) / 1000000))
      return 0
    fi
    if ! kill -0 "$PID" 2>/dev/null; then
      echo "warren exited while starting: see $OUT/$name.log" >&2
      exit 1
    fi
    sleep 0.02
  done
  echo "warren did not finish recovering within 10 minutes: see $OUT/$name.log" >&2
  exit 1
}

stop() {
  [ -n "$PID" ] || return 0
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  PID=""
}

# The recovery times the broker logs (definitions, then the queues' messages), in ms.
recovery_ms() {
  sed -n 's/.*\(definitions recovered\|recovered durable state\).* ms=\([0-9]*\).*/\2/p' "$OUT/$1.log" |
    paste -sd/ -
}

bench() {
  local name="$1"
  shift
  log "$name: warren-bench $*"
  echo "warren-bench -u $URL --broker-pid \$PID --json --label $name $*" >>"$OUT/commands.txt"
  # The machine is shared: what else ran when the step began (other CPU users skew lateness).
  echo "$name: $(cut -d' ' -f1-3 /proc/loadavg); busiest other processes over 1 s: $(top -b -n 2 -d 1 -w 200 |
    awk '/^top -/ {f++} f == 2 && $1 ~ /^[0-9]+$/ && $12 !~ /^(warren|warren-bench|top)$/ {print $12 " " $9 "%"}' |
    head -3 | paste -sd, -)" >>"$OUT/load.txt"
  # A run that reports errors (lost or early messages) exits 1: keep going, the summary shows them.
  # Its progress line (once a second) goes to NAME.progress.
  "$BENCH" -u "$URL" --broker-pid "$PID" --json --label "$name" "$@" >"$OUT/$name.json" \
    2>"$OUT/$name.progress" || log "$name: warren-bench reported errors (see $OUT/$name.json)"
}

# get RUN EXPR: a Python expression over the run's JSON report `r` (ms() and mb() format).
get() {
  python3 - "$OUT/$1.json" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
def ms(us): return f"{us / 1000:.1f}"
def mb(kb): return f"{kb / 1024:.0f}" if kb is not None else "?"
print(eval(sys.argv[2]))
EOF
}

lateness() {
  local name="$1"
  # An exchange of its own: the backlog's exchange and binding stay as they are.
  bench "$name" --ack-batched --delayed-rate "$RATE" --delay-ms "$DELAY" -z "$DURATION" -s "$SIZE" -f --durable \
    -c 1000 -q 200 -e "$name" --queue-pattern "$name"
  row "$name" "$2: $RATE msg/s, x-delay $DELAY ms, ${DURATION} s" \
    "$(get "$name" '"p50 %s / p90 %s / p99 %s / p99.9 %s / max %s ms; %d received, %d lost, %d early (%d by under 1 ms), %d duplicates; publish %.0f msg/s; broker cpu %.0f%%, RSS %s MB peak %s MB%s" % (ms(r["lateness"]["p50_us"]), ms(r["lateness"]["p90_us"]), ms(r["lateness"]["p99_us"]), ms(r["lateness"]["p999_us"]), ms(r["lateness"]["max_us"]), r["unique"], r["lost"], r["early"], r["early_sub_ms"], r["duplicates"], r["publish_rate"], r["broker"]["cpu_pct"], mb(r["broker"]["rss_end_kb"]), mb(r["broker"]["rss_peak_kb"]), "".join("; ERROR " + e for e in r["errors"]))')"
}

trap stop EXIT
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

{
  echo "# Delayed messages ($(date -u +%Y-%m-%d))"
  echo
  echo "\`bench/delayed.sh --messages $MESSAGES --rate $RATE --duration $DURATION --delay $DELAY --size $SIZE\`,"
  echo "Warren $REV, release build, $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM."
  echo "Persistent $SIZE-byte messages with confirms to a durable x-delayed-message exchange (x-delayed-type direct)"
  echo "bound to a durable queue. Warren alone: the RabbitMQ of this machine (3.10.8) has no delayed-message plugin."
  echo
  echo "| step | what | figure |"
  echo "|---|---|---|"
} >"$SUMMARY"
row() { echo "| $1 | $2 | $3 |" >>"$SUMMARY"; }

rm -rf "$DATA"
start first
row start "empty data directory" "started in $START_MS ms; RSS $(rss_mb "$PID") MB"
if has lateness; then
  lateness lateness "nothing else scheduled"
fi
SCHEDULED=0
if has schedule; then
  bench schedule --delayed-schedule "$MESSAGES" -s "$SIZE" -f --durable -c 1000 --settle 10 \
    --queue-pattern delayed-backlog
  SCHEDULED=1
  row schedule "schedule $MESSAGES, x-delay 1-2 h" \
    "$(get schedule '"%.0f msg/s (%.1f s); RSS %s MB after, %s MB after %.0f s, peak %s MB; broker cpu %.1f us/msg; %s already due%s" % (r["publish_rate"], r["publish_s"], mb(r["rss_after_publish_kb"]), mb(r["rss_after_pause_kb"]), r["pause_s"], mb(r["broker"]["rss_peak_kb"]), r["broker"]["cpu_us_per_published"] or 0, r["queue_depth_end"], "".join("; ERROR " + e for e in r["errors"]))')"
  sync
  row disk "data directory after scheduling" "$(du -sh "$DATA" | awk '{print $1}') ($(find "$DATA" -name '*.blob' | wc -l) blob files, $(find "$DATA" -name '*.sst' | wc -l) SST files)"
  if has lateness; then
    lateness lateness-backlog "with the $MESSAGES scheduled"
    row rss "after lateness-backlog" "RSS $(rss_mb "$PID") MB"
  fi
fi
if has restart && [ "$SCHEDULED" = 1 ]; then
  stop
  start restart
  row restart "clean stop and start with $MESSAGES scheduled on disk" \
    "recovered in $START_MS ms from launch (log: $(recovery_ms restart) ms); RSS $(rss_mb "$PID") MB"
  sleep 10
  row restart "10 s later (the earliest 8,192 read back)" "RSS $(rss_mb "$PID") MB"
  if has lateness; then
    lateness lateness-restarted "after the restart, with the $MESSAGES scheduled"
  fi
fi
row disk "data directory at the end" "$(du -sh "$DATA" | awk '{print $1}')"
stop
trap - EXIT
errors=$(cat "$OUT"/*.log | grep -c -E "(ERROR|WARN)" || true)
row logs "ERROR and WARN lines in the broker's logs" "$errors (see ${OUT#"$ROOT"/}/*.log)"
{
  echo
  echo "Load average (1, 5, 15 min) when each step began (2 cores; the machine may be shared):"
  echo
  sed 's/^/- /' "$OUT/load.txt"
} >>"$SUMMARY"
rm -rf "$DATA"
cat "$SUMMARY"
