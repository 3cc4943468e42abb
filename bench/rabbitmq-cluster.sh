#!/usr/bin/env bash
# A local 3-node RabbitMQ cluster (Debian's rabbitmq-server) on loopback, the reference that
# Warren's replicated queues are measured against: same machine, same client, quorum queues.
#
#   bench/rabbitmq-cluster.sh up          # install if missing, start three nodes, form the cluster
#   bench/rabbitmq-cluster.sh status      # the nodes and whether each runs
#   bench/rabbitmq-cluster.sh kill N      # SIGKILL node N (1-3): its beam.smp
#   bench/rabbitmq-cluster.sh start N     # start node N again on its data
#   bench/rabbitmq-cluster.sh roll        # a rolling restart, as RabbitMQ's upgrade guide does it:
#                                         # each node in turn once it is not quorum-critical,
#                                         # drained (rabbitmq-upgrade drain: its quorum queue
#                                         # leaders move, its clients are closed), stopped,
#                                         # started, awaited
#   bench/rabbitmq-cluster.sh down        # stop every node and delete the data
#
# Node N is rc<N>@localhost: AMQP on 5680+N, management API on 15680+N (guest/guest from
# loopback), Erlang distribution on 25680+N. Data and logs under $RABBIT_CLUSTER_DIR
# (default /tmp/warren-rabbitmq-cluster). Ports 5701-5703 stay free for Warren's own cluster.
# Quorum queues: declare with x-queue-type=quorum (3 members by default here).
set -euo pipefail

DIR="${RABBIT_CLUSTER_DIR:-/tmp/warren-rabbitmq-cluster}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

log() { printf '[rabbitmq-cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

node_env() {
  local n="$1" d="$DIR/rc$1"
  echo "RABBITMQ_NODENAME=rc$n@localhost RABBITMQ_NODE_PORT=$((5680 + n)) \
RABBITMQ_DIST_PORT=$((25680 + n)) RABBITMQ_MNESIA_BASE=$d/mnesia RABBITMQ_LOG_BASE=$d/log \
RABBITMQ_PID_FILE=$d/pid RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf \
RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins RABBITMQ_ADVANCED_CONFIG_FILE=$d/advanced.config"
}

ctl() {
  local n="$1"; shift
  $SUDO rabbitmqctl -q -n "rc$n@localhost" "$@"
}

install() {
  command -v rabbitmq-server >/dev/null 2>&1 && return
  log "installing rabbitmq-server from the distribution's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rabbitmq-server >/dev/null \
    || die "apt-get install rabbitmq-server failed: install it by hand, then run this again"
  # The package may start its own node on 5672; it does not get in the way of these.
}

prepare() {
  local n="$1" d="$DIR/rc$1"
  mkdir -p "$d/mnesia" "$d/log"
  cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$((5680 + n))
management.tcp.port = $((15680 + n))
management.tcp.ip = 127.0.0.1
EOF
  echo '[rabbitmq_management].' >"$d/enabled_plugins"
  echo '[].' >"$d/advanced.config"
  # Debian's rabbitmq-server drops to the rabbitmq user when started as root.
  if id rabbitmq >/dev/null 2>&1; then
    $SUDO chown -R rabbitmq:rabbitmq "$d"
  fi
}

start_node() {
  local n="$1"
  [ -d "$DIR/rc$n" ] || prepare "$n"
  log "starting rc$n@localhost (AMQP $((5680 + n)), management $((15680 + n)))"
  # shellcheck disable=SC2046
  $SUDO env $(node_env "$n") bash -c 'ulimit -n 65536 2>/dev/null || true; rabbitmq-server -detached'
  local i
  for i in $(seq 1 120); do
    if ctl "$n" await_startup >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  die "rc$n@localhost did not start within 60 s: see $DIR/rc$n/log"
}

# The node's beam.smp, from the pid file it writes (its command line does not name the node).
beam_pid() {
  local f="$DIR/rc$1/pid" pid
  [ -r "$f" ] || return 0
  pid="$(tr -dc '0-9' <"$f")"
  if [ -n "$pid" ] && [ -d "/proc/$pid" ]; then echo "$pid"; fi
}

up() {
  install
  mkdir -p "$DIR"
  local n
  for n in 1 2 3; do
    if [ -n "$(beam_pid "$n")" ]; then
      log "rc$n@localhost is already running"
    else
      start_node "$n"
    fi
  done
  for n in 2 3; do
    if ctl 1 cluster_status --formatter json 2>/dev/null | grep -q "\"rc$n@localhost\""; then
      continue
    fi
    log "rc$n@localhost joins rc1@localhost"
    ctl "$n" stop_app
    ctl "$n" join_cluster rc1@localhost
    ctl "$n" start_app
  done
  log "cluster formed: $(ctl 1 cluster_status --formatter json | python3 -c 'import json,sys; print(", ".join(json.load(sys.stdin)["running_nodes"]))')"
  log "AMQP: amqp://guest:guest@127.0.0.1:5681/%2f (and 5682, 5683)"
}

down() {
  local n pid
  for n in 1 2 3; do
    ctl "$n" stop >/dev/null 2>&1 || true
    pid="$(beam_pid "$n")"
    [ -n "$pid" ] && $SUDO kill -9 "$pid" 2>/dev/null || true
  done
  $SUDO rm -rf "$DIR"
  log "stopped; $DIR removed"
}

status() {
  local n pid
  for n in 1 2 3; do
    pid="$(beam_pid "$n")"
    echo "rc$n@localhost amqp=$((5680 + n)) http=$((15680 + n)) ${pid:+pid=}${pid:-stopped}"
  done
}

# Each node in turn: wait until no quorum queue needs it (the health check RabbitMQ's rolling
# upgrade guide names), put it in maintenance mode (its leaderships move to the other nodes),
# stop it cleanly, start it on its data, take it out of maintenance mode.
roll() {
  command -v curl >/dev/null || die "curl is needed to ask the nodes' health checks: apt-get install curl"
  local n pid deadline
  for n in 1 2 3; do
    [ -n "$(beam_pid "$n")" ] || die "rc$n@localhost is not running: start it before a roll"
  done
  for n in 1 2 3; do
    deadline=$((SECONDS + 120))
    until curl -fsS -o /dev/null -u guest:guest \
        "http://127.0.0.1:$((15680 + n))/api/health/checks/node-is-quorum-critical" 2>/dev/null; do
      [ $SECONDS -lt $deadline ] || die "rc$n@localhost is still quorum-critical after 120 s: the roll stops here"
      sleep 0.2
    done
    pid="$(beam_pid "$n")"
    log "rc$n@localhost: draining, then stopping"
    $SUDO rabbitmq-upgrade -q -n "rc$n@localhost" drain >/dev/null 2>&1 || log "rc$n@localhost: drain failed; stopping anyway"
    ctl "$n" stop >/dev/null 2>&1 || true
    while [ -n "$pid" ] && [ -d "/proc/$pid" ]; do sleep 0.1; done
    start_node "$n"
    # Out of maintenance mode, whether or not a restart ends it by itself.
    $SUDO rabbitmq-upgrade -q -n "rc$n@localhost" revive >/dev/null 2>&1 || true
  done
  log "rolled: every node restarted"
}

check_n() {
  case "${1:-}" in 1|2|3) ;; *) die "name a node: 1, 2 or 3" ;; esac
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  kill) check_n "${2:-}"; pid="$(beam_pid "$2")"; [ -n "$pid" ] || die "rc$2@localhost is not running"
        $SUDO kill -9 "$pid"; log "rc$2@localhost (pid $pid) killed" ;;
  start) check_n "${2:-}"; start_node "$2" ;;
  roll) roll ;;
  *) echo "usage: $0 up | down | status | kill N | start N | roll" >&2; exit 2 ;;
esac
