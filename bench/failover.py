#!/usr/bin/env python3
"""Failover of a replicated (quorum) queue, measured as a publisher sees it.

A pika publisher on a node that does not lead the queue publishes 1 KiB persistent messages with
confirms, one at a time; the leader's node is killed (SIGKILL); the gap is the time from the kill
to the confirm of the first message published after it (a confirm already on its way when the
node died does not count). The killed node is started again and caught up before
the next round, and each round kills whichever node leads then.

    python3 bench/failover.py warren   --kills 100   # a cluster from scripts/cluster (up)
    python3 bench/failover.py rabbitmq --kills 100   # a cluster from bench/rabbitmq-cluster.sh (up)

Prints each gap and then p50, p90, p99 and max. With --bystander a second publisher on the same
node publishes to another quorum queue, one the killed node does not lead: its longest wait for a
confirm from the kill to a second after the first publisher's first confirm says whether one
queue's failover holds back the confirms of another's publisher.

Needs pika (scripts/test installs it into clients/.deps/python, which this script uses).
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
    p.add_argument("--bystander", action="store_true",
                   help="a second publisher on the same node, to a queue the killed node does not lead")
    a = p.parse_args()
    amqp, mgmt, _, _ = TARGETS[a.target]
    nodes = [1, 2, 3]
    # Enough other queues that one of them is led elsewhere than the first.
    others = [f"{a.queue}-other-{i}" for i in range(6)] if a.bystander else []
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp + 1))
    for q in [a.queue] + others:
        c.channel().queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
    c.close()
    gaps = []
    waits = []
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
        other = None
        if others:
            led = {q: leader(a.target, q, nodes) for q in others}
            name = next((q for q in others if led[q] not in (None, lead)), None)
            if name is None:
                sys.exit(f"every other queue is led by node {lead}: rebalance and try again")
            other = Publisher(amqp + via, name)
            other.start()
        while len(pub.confirms) < 50 or (other and len(other.confirms) < 50):
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
        line = (f"round {i + 1}: node {lead} killed, publisher on node {via}: "
                f"first confirm after {gap:.3f} s ({pub.failures} nacks or errors)")
        if other:
            time.sleep(1)
            other.stop = True
            other.join(5)
            end = killed + gap + 1
            # The longest a publish of the other queue waited, or the longest spell between
            # two of its confirms, over the kill and the failover.
            spells = [done - started for (started, done) in other.confirms
                      if done > killed and started < end]
            times = [killed] + [done for (_, done) in other.confirms if killed < done < end]
            spells += [b - a for a, b in zip(times, times[1:])]
            wait = max(spells) if spells else float("inf")
            waits.append(wait)
            line += (f"; the other queue's publisher (queue led by node {led[other.queue]}): "
                     f"longest wait {wait:.3f} s ({other.failures} nacks or errors)")
        print(line, flush=True)
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
    if waits:
        waits.sort()
        print(f"{a.target}: the other queue's publisher's longest wait: "
              f"median {statistics.median(waits):.3f} s, max {waits[-1]:.3f} s")


if __name__ == "__main__":
    main()
