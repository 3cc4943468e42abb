#!/usr/bin/env python3
"""A rolling restart of a 3-node cluster under confirmed load, as publishers see it.

Three pika publishers (one per node to start with; each moves to the next node when its
connection breaks) publish 1 KiB persistent messages with confirms, one at a time, into one
quorum queue, while the cluster's own roll command restarts each node in turn (each once it is
not quorum-critical: stopped cleanly, started on its data, awaited). Two figures per roll: the
longest spell with no confirm at any publisher (the cluster's pause), and the longest one
publisher went without a confirm (what one client sees, its reconnection included); beside them
the same over a quiet second before the roll, the nacks, and the failed connections and
publishes. Afterwards the queue is drained and every confirmed message must be in it.

    python3 bench/roll.py warren   --rolls 2   # a cluster from scripts/cluster up
    python3 bench/roll.py rabbitmq --rolls 2   # a cluster from bench/rabbitmq-cluster.sh up

Needs pika (scripts/test installs it into clients/.deps/python, which this script uses).
"""

import argparse
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", ".deps", "python"))
import pika  # noqa: E402

TARGETS = {
    # AMQP port base (node N listens on base + N), the command whose `roll` restarts the nodes
    "warren": (5700, [os.path.join(ROOT, "scripts", "cluster")]),
    "rabbitmq": (5680, [os.path.join(ROOT, "bench", "rabbitmq-cluster.sh")]),
}
NODES = [1, 2, 3]


class Publisher(threading.Thread):
    """Publishes until told to stop; keeps (id, confirmed at) of every confirm."""

    def __init__(self, base, first, queue, name):
        super().__init__(daemon=True)
        self.base, self.node, self.queue, self.name = base, first, queue, name
        self.confirms = []
        self.nacks = 0
        # Publishes and connection attempts that failed (a closed connection, a node down).
        self.failed = 0
        self.stop = False

    def run(self):
        props = pika.BasicProperties(delivery_mode=2)
        ch = None
        seq = 0
        while not self.stop:
            try:
                if ch is None:
                    params = pika.ConnectionParameters(
                        "127.0.0.1", self.base + self.node, connection_attempts=1,
                        socket_timeout=2, blocked_connection_timeout=10)
                    conn = pika.BlockingConnection(params)
                    ch = conn.channel()
                    ch.confirm_delivery()
                seq += 1
                mid = f"{self.name}-{seq}"
                body = mid.encode().ljust(1024, b".")
                ch.basic_publish("", self.queue, body, props, mandatory=True)
                self.confirms.append((mid, time.monotonic()))
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError):
                self.nacks += 1
            except Exception:
                self.failed += 1
                ch = None
                self.node = self.node % len(NODES) + 1
                time.sleep(0.01)


def longest_gap(times, start, end):
    """The longest spell in [start, end] without any of `times`."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start] + inside + [end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def drain(base, queue):
    """Every message body left in the queue, read from whichever node answers."""
    for n in NODES:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", base + n))
            break
        except Exception:
            continue
    else:
        sys.exit("no node takes connections to drain the queue")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1000)
    got = set()
    # Until nothing came for 3 s.
    for method, _, body in ch.consume(queue, inactivity_timeout=3):
        if method is None:
            break
        got.add(body.rstrip(b".").decode())
        ch.basic_ack(method.delivery_tag)
    ch.cancel()
    conn.close()
    return got


def main():
    p = argparse.ArgumentParser()
    p.add_argument("target", choices=sorted(TARGETS))
    p.add_argument("--rolls", type=int, default=1)
    p.add_argument("--queue", default="roll")
    a = p.parse_args()
    base, control = TARGETS[a.target]
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", base + 1))
    ch = c.channel()
    ch.queue_declare(a.queue, durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_purge(a.queue)
    c.close()
    pubs = [Publisher(base, n, a.queue, f"p{n}") for n in NODES]
    for pub in pubs:
        pub.start()
    while any(len(pub.confirms) < 50 for pub in pubs):
        time.sleep(0.05)
    quiet_start = time.monotonic()
    time.sleep(1)
    quiet_end = time.monotonic()
    rolls = []
    for i in range(a.rolls):
        start = time.monotonic()
        subprocess.run(control + ["roll"], check=True, stdout=subprocess.DEVNULL)
        end = time.monotonic()
        rolls.append((start, end))
        # Every publisher confirms again before the next roll.
        marks = [len(pub.confirms) for pub in pubs]
        waited = time.monotonic()
        while any(len(pub.confirms) < m + 20 for pub, m in zip(pubs, marks)):
            if time.monotonic() - waited > 30:
                states = ", ".join(f"{pub.name} on node {pub.node}: {len(pub.confirms) - m} "
                                   f"confirms, {pub.failed} failures" for pub, m in zip(pubs, marks))
                sys.exit(f"a publisher confirmed nothing for 30 s after roll {i + 1}: {states}")
            time.sleep(0.05)
        print(f"roll {i + 1}: {end - start:.1f} s", flush=True)
    for pub in pubs:
        pub.stop = True
    for pub in pubs:
        pub.join(10)
    times = [t for pub in pubs for _, t in pub.confirms]
    confirmed = {mid for pub in pubs for mid, _ in pub.confirms}
    got = drain(base, a.queue)
    lost = confirmed - got
    def one(start, end):
        return max(longest_gap([t for _, t in pub.confirms], start, end) for pub in pubs)

    print(f"{a.target}: {len(confirmed)} confirmed, {sum(p.nacks for p in pubs)} nacked, "
          f"{sum(p.failed for p in pubs)} failed publishes or connection attempts, "
          f"{len(lost)} confirmed and lost")
    print(f"longest spell without a confirm at any publisher: quiet second "
          f"{longest_gap(times, quiet_start, quiet_end) * 1000:.0f} ms; rolls "
          + ", ".join(f"{longest_gap(times, s, e) * 1000:.0f} ms" for s, e in rolls))
    print(f"longest spell one publisher waited: quiet second "
          f"{one(quiet_start, quiet_end) * 1000:.0f} ms; rolls "
          + ", ".join(f"{one(s, e) * 1000:.0f} ms" for s, e in rolls))
    if lost:
        sys.exit(f"lost: {sorted(lost)[:10]}")


if __name__ == "__main__":
    main()
