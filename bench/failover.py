#!/usr/bin/env python3
"""Failover of a replicated (quorum) queue, measured as a publisher sees it.

A pika publisher on a node that does not lead the queue publishes 1 KiB persistent messages with
confirms, one at a time; the leader's node is killed (SIGKILL); the gap is the time from the kill
to the confirm of the first message published after it (a confirm already on its way when the
node died does not count). The killed node is started again and caught up before
the next round, and each round kills whichever node leads then.

    python3 bench/failover.py warren   --kills 100   # a cluster from scripts/cluster (up)
    python3 bench/failover.py rabbitmq --kills 100   # a cluster from bench/rabbitmq-cluster.sh (up)

Prints each gap and then p50, p90, p99 and max. Needs pika (scripts/test installs it into
clients/.deps/python, which this script uses).
"""

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", ".deps", "python"))
import pika  # noqa: E402

TARGETS = {
    # amqp port base, management port base, control script, leader name -> node number
    "warren": (5700, 15700, [os.path.join(ROOT, "scripts", "cluster")],
               lambda name: int(name.split("@")[0].split("-")[1])),
    "rabbitmq": (5680, 15680, [os.path.join(ROOT, "bench", "rabbitmq-cluster.sh")],
                 lambda name: int(name.split("@")[0][2:])),
}


def api(port, path):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())


def leader(t, queue, nodes):
    _, mgmt, _, parse = TARGETS[t]
    for n in nodes:
        try:
            q = api(mgmt + n, f"/queues/%2f/{queue}")
            if q.get("leader"):
                return parse(q["leader"])
        except Exception:
            pass
    return None


class Publisher(threading.Thread):
    def __init__(self, port, queue):
        super().__init__(daemon=True)
        self.port, self.queue = port, queue
        self.confirms = []
        self.failures = 0
        self.stop = False

    def run(self):
        body = b"x" * 1024
        props = pika.BasicProperties(delivery_mode=2)
        ch = None
        while not self.stop:
            try:
                if ch is None:
                    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port))
                    ch = conn.channel()
                    ch.confirm_delivery()
                started = time.monotonic()
                ch.basic_publish("", self.queue, body, props, mandatory=True)
                self.confirms.append((started, time.monotonic()))
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError):
                self.failures += 1
            except Exception:
                self.failures += 1
                ch = None
                time.sleep(0.01)


def control(t, *args):
    subprocess.run(TARGETS[t][2] + list(args), check=True, stdout=subprocess.DEVNULL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("target", choices=sorted(TARGETS))
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--queue", default="failover")
    a = p.parse_args()
    amqp, mgmt, _, _ = TARGETS[a.target]
    nodes = [1, 2, 3]
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp + 1))
    c.channel().queue_declare(a.queue, durable=True, arguments={"x-queue-type": "quorum"})
    c.close()
    gaps = []
    for i in range(a.kills):
        deadline = time.monotonic() + 30
        lead = None
        while lead is None and time.monotonic() < deadline:
            lead = leader(a.target, a.queue, nodes)
            time.sleep(0.05)
        if lead is None:
            sys.exit("no leader for the queue")
        via = next(n for n in nodes if n != lead)
        pub = Publisher(amqp + via, a.queue)
        pub.start()
        while len(pub.confirms) < 50:
            time.sleep(0.01)
        killed = time.monotonic()
        control(a.target, "kill", str(lead))
        def after():
            return [done for (started, done) in list(pub.confirms) if started > killed]
        while not after():
            if time.monotonic() - killed > 30:
                sys.exit(f"round {i}: no confirm 30 s after the kill")
            time.sleep(0.001)
        gap = min(after()) - killed
        gaps.append(gap)
        pub.stop = True
        pub.join(5)
        print(f"round {i + 1}: node {lead} killed, publisher on node {via}: "
              f"first confirm after {gap:.3f} s ({pub.failures} nacks or errors)", flush=True)
        control(a.target, "start", str(lead))
        # Caught up: the restarted node reports the queue again.
        while True:
            try:
                api(mgmt + lead, f"/queues/%2f/{a.queue}")
                break
            except Exception:
                time.sleep(0.05)
    gaps.sort()
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else gaps * 99
    print(f"{a.target}: {len(gaps)} kills, first confirm after the leader's kill: "
          f"p50 {q[49]:.3f} s, p90 {q[89]:.3f} s, p99 {q[98]:.3f} s, max {gaps[-1]:.3f} s")


if __name__ == "__main__":
    main()
