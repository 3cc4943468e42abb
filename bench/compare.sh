#!/usr/bin/env bash
# Runs the benchmark scenarios of issue 3 against RabbitMQ (A) and Warren (B), alternately
# (A B A B ...), and writes docs/benchmarks.md with the medians, the ratios and a chart.
#
#   bench/compare.sh                 # full run: 3 pairs, 20 s per timed run
#   bench/compare.sh --quick         # smoke test: 1 pair, 3 s runs, small idle/backlog counts
#   bench/compare.sh --self-test --quick --out /tmp/b.md   # both sides RabbitMQ: checks the pipeline
#
# See bench/README.md for every option.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INVOCATION="bench/compare.sh $*"
cd "$ROOT"

PAIRS=3
DURATION=20
INFLIGHT=1000
PAUSE=3
BACKLOG=1000000
IDLE_QUEUES=10000
IDLE_CONNECTIONS=1000
# Scenario 12's idle connections beside its 200 busy ones.
HOLD_CONNECTIONS=800
SCENARIOS="s6,s7,s1,s1r,s2,s2r,s3,s4,s5,s8,s9,s10,s11,s11r,s12"
OUT="docs/benchmarks.md"
CHART="bench/benchmarks.svg"
RESULTS=""
SELF_TEST=0
BUILD=1
CLEAN_BUILD=0
RESTART_RABBIT=auto
RABBIT_OURS=0
QUICK=0
WARREN_PORT=5690
# Warren's management API and Prometheus ports in the run (RabbitMQ's plugins hold 15672/15692).
WARREN_HTTP_PORT=15690
WARREN_METRICS_PORT=15691
SCRAPE=1
WARREN_BIN=""
WARREN_ARGS=""
# CPU lists (taskset -c) for both brokers and for the load generator; empty: not pinned.
BROKER_CPUS=""
BENCH_CPUS=""
WARREN_PID=""
RABBIT_URL="amqp://guest:guest@127.0.0.1:5672/%2f"
WARREN_STORAGE="RocksDB (a fresh --data-dir per start): persistent messages on durable queues are fsynced before their confirm, one synced write per group of publishes"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; cat <<'EOF'
Options:
  --pairs N              A/B pairs per scenario (default 3)
  --duration S           seconds per timed run (default 20)
  --pause S              seconds between runs (default 3)
  --inflight N           unthrottled scenarios hold producers back beyond N unconsumed messages
                         per queue, measuring the sustainable rate (default 1000; 0 = PerfTest-style
                         unbounded publishing, where the queue grows all run long)
  --quick                1 pair, 3 s runs, backlog 20000, 500 idle queues, 100 idle connections,
                         80 held beside scenario 12's busy ones
  --scenarios LIST       comma-separated subset of s1,s1r,s2,s2r,s3,s4,s5,s6,s7,s8,s9,s10,s11,s11r,s12
  --backlog N            messages in scenario 8 (default 1000000)
  --idle-queues N        queues in scenario 6 (default 10000)
  --idle-connections N   connections in scenario 7 (default 1000)
  --out FILE             report (default docs/benchmarks.md)
  --chart FILE           SVG chart (default bench/benchmarks.svg)
  --results DIR          where the JSON of every run goes (default bench/results/<time>)
  --self-test            side B is RabbitMQ too (checks the pipeline without Warren)
  --no-build             use the binaries already built
  --clean-build          build a clean export of HEAD (ignores uncommitted changes in the tree)
  --restart-rabbitmq     restart RabbitMQ before each idle-scenario run (default: only if this
                         script started it); --no-restart-rabbitmq never does
  --warren-port P        port for Warren (default 5690)
  --warren-bin PATH      Warren binary (default: the release build)
  --no-scrape            do not scrape the brokers' management API and Prometheus endpoint
                         during the timed runs (by default each is read once a second, as a
                         dashboard and Prometheus would: /api/overview, the first page of
                         /api/queues, /metrics)
  --broker-cpus LIST     pin both brokers to these CPUs (taskset -c LIST; RabbitMQ's beam.smp with
                         every thread), so that they do not share a core with the load generator
  --bench-cpus LIST      pin the load generator (warren-bench) to these CPUs, e.g.
                         --broker-cpus 0 --bench-cpus 1 on a 2-core machine
  --warren-args "..."    extra arguments for Warren
  --warren-pid PID       use an already running Warren on --warren-port instead of starting one
  --rabbit-url URL       RabbitMQ URL (default amqp://guest:guest@127.0.0.1:5672/%2f)
  --warren-storage TEXT  what Warren persists, for the report

A RabbitMQ this script started is stopped when it ends (KEEP_RABBITMQ=1 keeps it running);
one that was running already is left as it was.
EOF
}

for arg in "$@"; do
  if [ "$arg" = --quick ]; then
    # Quick defaults first; options given explicitly below still win.
    QUICK=1; PAIRS=1; DURATION=3; PAUSE=1; BACKLOG=20000; IDLE_QUEUES=500; IDLE_CONNECTIONS=100; HOLD_CONNECTIONS=80
  fi
done
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) PAIRS="$2"; shift ;;
    --duration) DURATION="$2"; shift ;;
    --pause) PAUSE="$2"; shift ;;
    --inflight) INFLIGHT="$2"; shift ;;
    --quick) QUICK=1 ;;
    --scenarios) SCENARIOS="$2"; shift ;;
    --backlog) BACKLOG="$2"; shift ;;
    --idle-queues) IDLE_QUEUES="$2"; shift ;;
    --idle-connections) IDLE_CONNECTIONS="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --chart) CHART="$2"; shift ;;
    --results) RESULTS="$2"; shift ;;
    --self-test) SELF_TEST=1 ;;
    --no-build) BUILD=0 ;;
    --clean-build) CLEAN_BUILD=1 ;;
    --restart-rabbitmq) RESTART_RABBIT=1 ;;
    --no-restart-rabbitmq) RESTART_RABBIT=0 ;;
    --warren-port) WARREN_PORT="$2"; shift ;;
    --warren-bin) WARREN_BIN="$2"; shift ;;
    --warren-args) WARREN_ARGS="$2"; shift ;;
    --broker-cpus) BROKER_CPUS="$2"; shift ;;
    --bench-cpus) BENCH_CPUS="$2"; shift ;;
    --warren-pid) WARREN_PID="$2"; shift ;;
    --rabbit-url) RABBIT_URL="$2"; shift ;;
    --warren-storage) WARREN_STORAGE="$2"; shift ;;
    --no-scrape) SCRAPE=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[compare %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

# ---------------------------------------------------------------- RabbitMQ (side A)
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  log "installing rabbitmq-server from the distribution's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rabbitmq-server >/dev/null
fi
start_rabbit() {
  # RabbitMQ sizes its socket limit from the file-descriptor limit it starts with; 1024 would
  # stop scenario 7 at about 830 connections. Debian's rabbitmq-server switches to the rabbitmq
  # user with su, whose pam_limits resets the limit to limits.conf's: raise it there too.
  if [ -d /etc/security/limits.d ] && [ ! -e /etc/security/limits.d/rabbitmq.conf ]; then
    printf 'rabbitmq soft nofile 20000\nrabbitmq hard nofile 20000\n' |
      $SUDO tee /etc/security/limits.d/rabbitmq.conf >/dev/null || true
  fi
  # The runs read RabbitMQ's management API and Prometheus endpoint as they read Warren's: a
  # RabbitMQ without those plugins (Debian enables none) would answer nothing and do less.
  if [ "$SCRAPE" = 1 ] &&
    ! $SUDO rabbitmq-plugins --offline enable rabbitmq_management rabbitmq_prometheus >/dev/null 2>&1; then
    log "could not enable RabbitMQ's management and prometheus plugins: its scrapes will fail"
  fi
  $SUDO bash -c 'ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true; rabbitmq-server -detached'
  sleep 2
  rabbitmqctl -q await_startup >/dev/null 2>&1 || { sleep 5; rabbitmqctl -q await_startup; }
}
# taskset in front of a command when CPUs are given (an empty prefix otherwise).
pinned() {
  if [ -n "$1" ]; then echo "taskset -c $1"; fi
}
# Every thread of RabbitMQ's VM onto --broker-cpus (its schedulers are threads of beam.smp).
pin_rabbit() {
  [ -n "$BROKER_CPUS" ] || return 0
  command -v taskset >/dev/null || { echo "--broker-cpus needs taskset (apt-get install util-linux)" >&2; exit 1; }
  $SUDO taskset -a -p -c "$BROKER_CPUS" "$RABBIT_PID" >/dev/null
}
rabbit_pid() {
  local pid
  pid="$(rabbitmqctl -q eval 'list_to_integer(os:getpid()).' 2>/dev/null | tr -dc 0-9)"
  if [ -z "$pid" ] || [ ! -d "/proc/$pid" ]; then
    pid="$(pgrep -o -x beam.smp || true)"
  fi
  [ -n "$pid" ] || { echo "cannot find RabbitMQ's beam.smp pid" >&2; exit 1; }
  echo "$pid"
}
if ! rabbitmqctl -q status >/dev/null 2>&1; then
  log "starting RabbitMQ"
  start_rabbit
  RABBIT_OURS=1
fi
rabbitmqctl -q await_startup >/dev/null 2>&1 || { sleep 5; rabbitmqctl -q await_startup; }
RABBIT_PID="$(rabbit_pid)"
pin_rabbit
# Restarting RabbitMQ before the idle scenarios is only done when this script started it (or
# when asked): on a shared machine someone else may be using it.
[ "$RESTART_RABBIT" = auto ] && RESTART_RABBIT="$RABBIT_OURS"
RABBIT_VERSION="$(rabbitmqctl -q version 2>/dev/null || dpkg-query -W -f '${Version}' rabbitmq-server)"
ERLANG_VERSION="$(rabbitmqctl -q eval 'erlang:system_info(otp_release).' 2>/dev/null | tr -d '"' || echo '?')"
log "RabbitMQ $RABBIT_VERSION (OTP $ERLANG_VERSION), beam.smp pid $RABBIT_PID"
# Scenario 7 needs that many free sockets on RabbitMQ (a RabbitMQ started elsewhere with
# `ulimit -n 1024` allows about 830): use what is free, on both sides alike, and say so.
SOCKETS_LINE="$(rabbitmqctl -q status 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -m1 '^Sockets:' || true)"
SOCKETS_USED="$(echo "$SOCKETS_LINE" | sed -n 's/^Sockets: *\([0-9]*\),.*/\1/p')"
SOCKETS_LIMIT="$(echo "$SOCKETS_LINE" | sed -n 's/.*limit: *\([0-9]*\).*/\1/p')"
IDLE_CONNECTIONS_NOTE=""
if [ -n "$SOCKETS_LIMIT" ] && [ -n "$SOCKETS_USED" ]; then
  FREE_SOCKETS=$((SOCKETS_LIMIT - SOCKETS_USED - 100))
  if [ "$FREE_SOCKETS" -lt "$IDLE_CONNECTIONS" ]; then
    IDLE_CONNECTIONS_NOTE="RabbitMQ's socket limit is $SOCKETS_LIMIT (started with a low \`ulimit -n\`), so scenario 7 opened $FREE_SOCKETS connections instead of $IDLE_CONNECTIONS on both brokers; restart RabbitMQ with \`ulimit -n 65536\` for the full count."
    log "WARNING: $IDLE_CONNECTIONS_NOTE"
    IDLE_CONNECTIONS="$FREE_SOCKETS"
  fi
fi

# ---------------------------------------------------------------- build
TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
export CARGO_TARGET_DIR="$TARGET_DIR"
[ -n "$RESULTS" ] || RESULTS="bench/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RESULTS/bin"
SRC="$ROOT"
CLEAN_SRC=""
GIT_REV="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$CLEAN_BUILD" = 1 ]; then
  # Build exactly HEAD: uncommitted work in the tree does not end up in the measured binaries.
  CLEAN_SRC="$(mktemp -d)"
  # -m: files get the time of extraction, so cargo rebuilds them rather than reusing a newer build
  # of the working tree (uncommitted changes included).
  git archive HEAD | tar -x -m -C "$CLEAN_SRC"
  SRC="$CLEAN_SRC"
  GIT_REV="$GIT_REV (clean build of HEAD)"
elif [ -n "$(git status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null)" ]; then
  GIT_REV="$GIT_REV (with uncommitted changes)"
fi
if [ "$BUILD" = 1 ]; then
  if [ "$SELF_TEST" = 1 ]; then
    log "building warren-bench (release)"
    (cd "$SRC" && cargo build --release -q -p warren-bench)
  else
    log "building warren and warren-bench (release)"
    (cd "$SRC" && cargo build --release -q -p warren-server -p warren-bench)
  fi
fi
[ -n "$CLEAN_SRC" ] && rm -rf "$CLEAN_SRC"
# Run private copies: a rebuild in the shared target directory during the run changes nothing.
cp "$TARGET_DIR/release/warren-bench" "$RESULTS/bin/" ||
  { echo "missing $TARGET_DIR/release/warren-bench (build it or drop --no-build)" >&2; exit 1; }
BENCH="$RESULTS/bin/warren-bench"
if [ -z "$WARREN_BIN" ] && [ "$SELF_TEST" = 0 ] && [ -z "$WARREN_PID" ]; then
  cp "$TARGET_DIR/release/warren" "$RESULTS/bin/" ||
    { echo "missing $TARGET_DIR/release/warren (build it or drop --no-build)" >&2; exit 1; }
  WARREN_BIN="$RESULTS/bin/warren"
fi
[ -n "$WARREN_BIN" ] || WARREN_BIN="$TARGET_DIR/release/warren"

# ---------------------------------------------------------------- Warren (side B)
STARTED_WARREN=""
cleanup() {
  if [ -n "$STARTED_WARREN" ] && kill -0 "$STARTED_WARREN" 2>/dev/null; then
    log "stopping Warren (pid $STARTED_WARREN)"
    kill "$STARTED_WARREN" 2>/dev/null || true
    wait "$STARTED_WARREN" 2>/dev/null || true
  fi
  rm -rf "$RESULTS/warren-data"
  # A RabbitMQ this script started goes with it (it holds port 5672 and a few hundred MB), unless
  # KEEP_RABBITMQ=1 keeps it for the next run.
  if [ "${RABBIT_OURS:-0}" = 1 ] && [ "${KEEP_RABBITMQ:-0}" != 1 ]; then
    log "stopping RabbitMQ (started by this run; KEEP_RABBITMQ=1 keeps it)"
    rabbitmqctl -q stop >/dev/null 2>&1 || true
    return 0
  fi
  # A RabbitMQ that keeps running gets every CPU back.
  if [ -n "$BROKER_CPUS" ] && [ -n "${RABBIT_PID:-}" ] && [ -d "/proc/$RABBIT_PID" ]; then
    $SUDO taskset -a -p -c "0-$(($(nproc) - 1))" "$RABBIT_PID" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

WARREN_RESTARTS=0
start_warren() {
  log "starting Warren on 127.0.0.1:$WARREN_PORT"
  # Every start begins empty, as a restarted RabbitMQ has no queues of earlier scenarios either.
  rm -rf "$RESULTS/warren-data"
  # shellcheck disable=SC2086
  $(pinned "$BROKER_CPUS") "$WARREN_BIN" --bind 127.0.0.1 --port "$WARREN_PORT" --data-dir "$RESULTS/warren-data" \
    --management-port "$WARREN_HTTP_PORT" --prometheus-port "$WARREN_METRICS_PORT" $WARREN_ARGS \
    >>"$RESULTS/warren.log" 2>&1 &
  STARTED_WARREN=$!
  B_PID=$STARTED_WARREN
  for _ in $(seq 1 100); do
    port_open "$WARREN_PORT" && break
    kill -0 "$STARTED_WARREN" 2>/dev/null || { echo "Warren exited; see $RESULTS/warren.log" >&2; exit 1; }
    sleep 0.1
  done
  port_open "$WARREN_PORT" || { echo "Warren does not listen on $WARREN_PORT" >&2; exit 1; }
  # A broker that listens but cannot complete a handshake would only produce failed runs.
  if ! "$BENCH" --url "amqp://guest:guest@127.0.0.1:$WARREN_PORT/%2f" --idle-connections 1 \
      --settle 0 --quiesce 0 --quiet >/dev/null 2>"$RESULTS/warren-handshake.log"; then
    echo "Warren on port $WARREN_PORT does not complete an AMQP handshake:" >&2
    cat "$RESULTS/warren-handshake.log" >&2
    exit 1
  fi
}

restart_rabbit() {
  log "restarting RabbitMQ (fresh memory for the idle scenario)"
  rabbitmqctl -q stop >/dev/null 2>&1 || true
  start_rabbit
  RABBIT_PID="$(rabbit_pid)"
  pin_rabbit
  A_PID="$RABBIT_PID"
  [ "$SELF_TEST" = 1 ] && B_PID="$RABBIT_PID"
  return 0
}

restart_warren() {
  kill "$STARTED_WARREN" 2>/dev/null || true
  wait "$STARTED_WARREN" 2>/dev/null || true
  STARTED_WARREN=""
  start_warren
}

# On a shared machine something may stop our Warren between runs; start it again and say so.
ensure_warren() {
  [ -n "$STARTED_WARREN" ] || return 0
  kill -0 "$STARTED_WARREN" 2>/dev/null && return 0
  wait "$STARTED_WARREN" 2>/dev/null || true
  WARREN_RESTARTS=$((WARREN_RESTARTS + 1))
  log "WARNING: Warren (pid $STARTED_WARREN) has exited (see $RESULTS/warren.log); restarting it"
  start_warren
}

if [ "$SELF_TEST" = 1 ]; then
  A_NAME="RabbitMQ"; B_NAME="RabbitMQ (B)"
  B_URL="$RABBIT_URL"; B_PID="$RABBIT_PID"; B_VERSION="$RABBIT_VERSION"
else
  A_NAME="RabbitMQ"; B_NAME="Warren"
  B_URL="amqp://guest:guest@127.0.0.1:$WARREN_PORT/%2f"
  if [ -n "$WARREN_PID" ]; then
    B_PID="$WARREN_PID"
  else
    [ -x "$WARREN_BIN" ] || { echo "missing Warren binary $WARREN_BIN" >&2; exit 1; }
    if port_open "$WARREN_PORT"; then
      echo "port $WARREN_PORT is already taken; stop that process or pass --warren-pid" >&2; exit 1
    fi
    start_warren
  fi
  B_VERSION="$("$WARREN_BIN" --version 2>/dev/null | head -1 || echo '?')"
fi
A_URL="$RABBIT_URL"; A_PID="$RABBIT_PID"
log "A = $A_NAME (pid $A_PID), B = $B_NAME (pid $B_PID); results in $RESULTS"

# ---------------------------------------------------------------- scenarios
# Arguments of each scenario, without URL, pid, queue names and output flags. warren-bench's
# consumer is a worker (each ack awaited) by default; the scenarios of issue 3 keep the batched
# acks they were first measured with (--ack-batched), so their figures stay comparable.
scenario_args() {
  case "$1" in
    s1)  echo "--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --max-inflight $INFLIGHT -z $DURATION" ;;
    s1r) echo "--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 -z $DURATION" ;;
    s2)  echo "--ack-batched -x 1 -y 1 --queues 1 -s 1024 --persistent --durable --confirm 1000 -q 200 --max-inflight $INFLIGHT -z $DURATION" ;;
    s2r) echo "--ack-batched -x 1 -y 1 --queues 1 -s 1024 --persistent --durable --confirm 1000 -q 200 --rate 5000 -z $DURATION" ;;
    s3)  echo "--ack-batched -x 1 -y 10 --queues 10 -e EXCHANGE -t fanout -s 16 -q 200 --max-inflight $((INFLIGHT * 10)) -z $DURATION" ;;
    s4)  echo "--ack-batched -x 10 -y 10 --queues 10 -s 1024 -q 200 --max-inflight $((INFLIGHT * 10)) -z $DURATION" ;;
    s5)  echo "--ack-batched -x 1 -y 1 --queues 1 -s 1024 -q 200 --rate 10000 -z $DURATION" ;;
    s6)  echo "--idle-queues $IDLE_QUEUES" ;;
    s7)  echo "--idle-connections $IDLE_CONNECTIONS --parallel 4" ;;
    # The two shapes a task queue lives in: a worker that writes each ack before it takes the
    # next message (s9, s1r's load otherwise), and a producer that outruns such a worker, with
    # no in-flight cap, so that the queue grows for the whole run (s10). s10 gives the client two
    # tokio workers: on one, the unthrottled producer delays the worker's wake-ups after each
    # ack and the consume rate would measure the load generator rather than the broker.
    s9)  echo "-x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 --ack-wait -z $DURATION" ;;
    s10) echo "-x 1 -y 1 --queues 1 -s 1024 -q 200 --ack-wait --consume-rate 5000 --threads 2 -z $DURATION" ;;
    # Scenario 1 on a queue with a message TTL and a dead-letter exchange (nothing expires: the
    # cost is the bookkeeping every message pays), unthrottled and at 5,000 msg/s.
    s11) echo "--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --max-inflight $INFLIGHT --queue-arg x-message-ttl=60000 --queue-arg x-dead-letter-exchange=wb-dlx -z $DURATION" ;;
    s11r) echo "--ack-batched -x 1 -y 1 --queues 1 -s 16 -q 200 --rate 5000 --queue-arg x-message-ttl=60000 --queue-arg x-dead-letter-exchange=wb-dlx -z $DURATION" ;;
    # Many clients, few busy: 1,000 connections, of which 100 workers (as s9's, each ack
    # awaited) and their 100 producers at 50 msg/s each (5,000 msg/s in all, as s9), on 100
    # queues; the other 800 stay connected and idle all run long (--hold-connections).
    s12) echo "-x 100 -y 100 --queues 100 -s 16 -q 200 --rate 50 --ack-wait --hold-connections $HOLD_CONNECTIONS --parallel 4 --threads 2 -z $DURATION" ;;
    s8p) echo "--no-consume -x 1 -y 0 --queues 1 -s 1024 -C $BACKLOG" ;;
    s8d) echo "--ack-batched --predeclare --delete --no-reset-peak -x 0 -y 1 --queues 1 -q 200 -C $BACKLOG" ;;
    *) echo "unknown scenario $1" >&2; exit 2 ;;
  esac
}

COMMANDS="$RESULTS/commands.txt"
: >"$COMMANDS"
record_command() {
  # The exact command, with the machine-specific parts as variables.
  grep -qxF -- "$1" "$COMMANDS" 2>/dev/null || echo "$1" >>"$COMMANDS"
}

# scrape SIDE: reads the side's management API and metrics once a second until killed, as a
# dashboard and Prometheus would; counts answers and failures per side in the results.
scrape() {
  local side="$1" http metrics ok=0 failed=0
  if [ "$side" = A ] || [ "$SELF_TEST" = 1 ]; then
    http="http://guest:guest@127.0.0.1:15672"; metrics="http://127.0.0.1:15692"
  else
    http="http://guest:guest@127.0.0.1:$WARREN_HTTP_PORT"; metrics="http://127.0.0.1:$WARREN_METRICS_PORT"
  fi
  trap 'echo "$ok $failed" >>"$RESULTS/scrapes-$side"; exit 0' TERM
  while true; do
    for u in "$http/api/overview" "$http/api/queues?page=1&page_size=100" "$metrics/metrics"; do
      if curl -sf -o /dev/null --max-time 5 "$u"; then ok=$((ok + 1)); else failed=$((failed + 1)); fi
    done
    sleep 1
  done
}

scrape_note() {
  [ "$SCRAPE" = 1 ] || { echo "The management API and metrics were not scraped (--no-scrape)."; return; }
  local a b
  a="$(awk '{o+=$1; f+=$2} END {printf "%d answered, %d failed", o, f}' "$RESULTS/scrapes-A" 2>/dev/null)"
  b="$(awk '{o+=$1; f+=$2} END {printf "%d answered, %d failed", o, f}' "$RESULTS/scrapes-B" 2>/dev/null)"
  echo "During every timed run the broker's management API (/api/overview, the first page of /api/queues) and Prometheus endpoint (/metrics) were read once a second, as a dashboard and Prometheus would: RabbitMQ ${a:-not scraped}, Warren ${b:-not scraped}."
}

# run_one SCENARIO SIDE PAIR
run_one() {
  local scen="$1" side="$2" pair="$3" url pid name base args tag out
  [ "$side" = A ] || ensure_warren
  if [ "$scen" = s6 ] || [ "$scen" = s7 ]; then
    # Memory per idle item from a fresh process: the allocator would otherwise hand the previous
    # run's freed memory to this one and make an item look free.
    if [ "$side" = B ] && [ -n "$STARTED_WARREN" ]; then
      restart_warren
    elif [ "$RESTART_RABBIT" = 1 ] && { [ "$side" = A ] || [ "$SELF_TEST" = 1 ]; }; then
      restart_rabbit
    fi
  fi
  if [ "$side" = A ]; then url="$A_URL"; pid="$A_PID"; name="$A_NAME"; else url="$B_URL"; pid="$B_PID"; name="$B_NAME"; fi
  case "$scen" in s8p|s8d) base=s8 ;; *) base="$scen" ;; esac
  tag="wb-$base-$side$pair-$$"
  args="$(scenario_args "$scen")"
  args="${args//EXCHANGE/$tag-fanout}"
  record_command "warren-bench --url \$URL --broker-pid \$PID --json --queue-pattern wb-$base-%d ${args//$tag-fanout/wb-fanout}"
  out="$RESULTS/$scen-$side-$pair.json"
  log "$scen pair $pair: $name"
  local scraper=""
  if [ "$SCRAPE" = 1 ]; then
    scrape "$side" &
    scraper=$!
  fi
  # shellcheck disable=SC2086
  if ! $(pinned "$BENCH_CPUS") "$BENCH" --url "$url" --broker-pid "$pid" --json --label "$scen/$side/$pair" \
      --queue-pattern "$tag-%d" $args >"$out" 2>"$RESULTS/$scen-$side-$pair.log"; then
    log "  $scen on $name failed (see $RESULTS/$scen-$side-$pair.log)"
    tail -3 "$RESULTS/$scen-$side-$pair.log" >&2 || true
  fi
  if [ -n "$scraper" ]; then
    kill "$scraper" 2>/dev/null || true
    wait "$scraper" 2>/dev/null || true
  fi
  python3 bench/report.py --summarize "$out" >&2 || true
  sleep "$PAUSE"
}

busy_count() { local n; n="$(pgrep -c -x 'cargo|rustc' 2>/dev/null || true)"; echo "${n:-0}"; }
BUSY_AT_START="$(busy_count)"
LOAD_AT_START="$(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$BUSY_AT_START" != 0 ]; then
  log "WARNING: $BUSY_AT_START cargo/rustc processes are running: the figures will be noisy"
fi
MAX_BUSY="$BUSY_AT_START"

START_TIME="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
IFS=',' read -r -a SCEN_LIST <<<"$SCENARIOS"
for scen in "${SCEN_LIST[@]}"; do
  for pair in $(seq 1 "$PAIRS"); do
    for side in A B; do
      b="$(busy_count)"; [ "$b" -gt "$MAX_BUSY" ] && MAX_BUSY="$b"
      if [ "$scen" = s8 ]; then
        run_one s8p "$side" "$pair"
        run_one s8d "$side" "$pair"
      else
        run_one "$scen" "$side" "$pair"
      fi
    done
  done
done
END_TIME="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

# ---------------------------------------------------------------- machine and report
python3 - "$RESULTS/meta.json" <<EOF
import json, sys, platform, subprocess
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        return "?"
mem_kb = int(sh("awk '/MemTotal/ {print \$2}' /proc/meminfo") or 0)
meta = {
    "start": "$START_TIME", "end": "$END_TIME",
    "quick": $QUICK == 1, "self_test": $SELF_TEST == 1,
    "pairs": $PAIRS, "duration_s": $DURATION, "pause_s": $PAUSE, "inflight": $INFLIGHT,
    "invocation": """$INVOCATION""",
    "backlog": $BACKLOG, "idle_queues": $IDLE_QUEUES, "idle_connections": $IDLE_CONNECTIONS,
    "scenarios": "$SCENARIOS".split(","),
    "a_name": "$A_NAME", "b_name": "$B_NAME",
    "a_version": "RabbitMQ $RABBIT_VERSION (Erlang/OTP $ERLANG_VERSION)",
    "b_version": """$B_VERSION""",
    "git_rev": "$GIT_REV",
    "warren_storage": """$WARREN_STORAGE""",
    "warren_args": "$WARREN_ARGS", "warren_port": $WARREN_PORT,
    "broker_cpus": "$BROKER_CPUS", "bench_cpus": "$BENCH_CPUS",
    "fresh_for_idle": {"A": $RESTART_RABBIT == 1,
                       "B": ($RESTART_RABBIT == 1) if $SELF_TEST else ("$WARREN_PID" == "")},
    "notes": [n for n in ["""$IDLE_CONNECTIONS_NOTE""", """$(scrape_note)""",
        "Warren exited during the run and was restarted $WARREN_RESTARTS time(s) (see warren.log in the results)" if $WARREN_RESTARTS else ""] if n],
    "machine": {
        "nproc": sh("nproc"),
        "cpu": sh("lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1") or platform.processor(),
        "memory_gib": round(mem_kb / 1048576, 1),
        "kernel": sh("uname -sr"),
        "os": sh(". /etc/os-release && echo \$PRETTY_NAME"),
        "rustc": sh("rustc --version"),
    },
    "busy_at_start": $BUSY_AT_START, "max_busy": $MAX_BUSY, "load_at_start": "$LOAD_AT_START",
    "commands": open("$COMMANDS").read().splitlines(),
}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
python3 bench/report.py --results "$RESULTS" --out "$OUT" --chart "$CHART"
log "wrote $OUT and $CHART"
