#!/usr/bin/env python3
"""A pool of pika workers on a Warren task queue, end to end: some jobs crash their worker, some run long and
extend their visibility timeout, some always fail, and some belong to message groups.

Usage: python3 worker_pool.py amqp://guest:guest@127.0.0.1:5672/%2f

The driver (this script) declares a dead-letter exchange (fanout) and queue, and a durable work queue with
`x-visibility-timeout`, `x-delivery-limit`, `x-dead-letter-exchange`, `x-delayed-retry-min` and
`x-group-header` = "x-group-key". It starts 4 worker processes (this script with `--worker`, each with its own
connection and prefetch), publishes a few hundred persistent jobs with publisher confirms, restarts every worker
that crashes, and waits until every job is done or dead-lettered. Kinds of jobs (header `x-kind`):

- plain: a few ms of work, then an ack;
- crash: the first worker to start one (a marker file decides) exits at once with os._exit, without acking:
  the broker sees its connection drop and gives the job (and whatever else that worker held) to another worker;
- long: runs for 6 visibility timeouts and extends its delivery every 100 ms (by 2 timeouts) by publishing to
  `amq.warren.visibility` (headers `x-delivery-tag`, `x-visibility-timeout`) with confirms: it must never be
  redelivered while it runs, and is done exactly once;
- stall: the first run lets its delivery time out (no extension) and acks late: the broker gives the job to
  a worker again (if one has a free prefetch slot before the late ack; else the late ack settles it);
- poison: always nacked with requeue: it must end in the dead-letter queue with an `x-death` entry of reason
  `delivery_limit`, and is never done.
Jobs of 10 groups (header `x-group-key`, sequence number in `x-seq`) are mostly plain, with two crash, one long
and two poison jobs among them: a group's jobs must run one at a time, in publish order.

A worker busy with a long or stalled job also extends the deliveries waiting in its prefetch buffer: were they to
time out, each timeout would give the consumer its prefetch slot back, the broker would fill it at once, and every
job landing behind the long one would lose one of its tries (a few jobs then reach the delivery limit). Every
worker starts a job by claiming it, with one more extension: if it is refused (the delivery timed out anyway) the
worker skips the job, which the broker has already given back to the queue.

Each worker appends its events (received, skipped, start, end, with job id, group, sequence, worker,
`x-delivery-count`, monotonic time) to its own file; the driver reads them and checks at the end:
- every job but the poison ones was done at least once;
- every poison job is in the dead-letter queue exactly once, with reason delivery_limit, and nothing else is;
- every long job was started once, done once, extended without a refusal, and never delivered again once started;
- in each group, the first completions follow the sequence numbers, and no two of the group's jobs were ever
  being worked on at the same time (the start-end intervals of every attempt, crashed or failed ones included,
  do not overlap);
- the work queue is empty, with no consumer, once the workers are stopped.
Prints one "ok - ..." summary line and exits 0, or "FAIL: ..." lines and exits 1. The whole flow is bounded
(DEADLINE seconds to get every job through, a few more to stop). With WARREN_POOL_KEEP=1 the workers' event files
are kept (the directory is printed) for a look after a failure.
"""

import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

try:
    import pika
    from pika.exceptions import NackError
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import pika: {e} (scripts/test installs it into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

VISIBILITY_MS = 300  # the queue's x-visibility-timeout
DELIVERY_LIMIT = 3  # a poison job is tried 4 times, then dead-lettered
RETRY_MIN_MS = 20  # x-delayed-retry-min: 20 ms, 40 ms, 60 ms between a poison job's tries
GROUP_HEADER = "x-group-key"
CLAIM_MS = 2_000  # a started job's delivery is held this long (every job but a long one ends well before)
LONG_MS = 6 * VISIBILITY_MS  # a long job's run
EXTEND_EVERY = 0.1  # s between a long job's extensions...
EXTEND_MS = 2 * VISIBILITY_MS  # ...each by two visibility timeouts from then (a long job needs 3 or more)
HELD_EVERY = 0.5  # s between the extensions (by CLAIM_MS) of a delivery waiting behind a long or stalled job
STALL_MS = 2 * VISIBILITY_MS  # a stall job's first run: its delivery times out meanwhile
WORKERS = 4
PREFETCH = 3
CRASH_EXIT = 17  # a worker's exit code after crashing on purpose
DEADLINE = 40.0  # s for every job to be done or dead-lettered
VIS_EXCHANGE = "amq.warren.visibility"

N_PLAIN = 150
N_GROUPS = 10
GROUP_SIZE = 12
N_CRASH, N_LONG, N_POISON, N_STALL = 6, 4, 4, 4  # outside groups
# Special jobs inside groups: (group, sequence) -> kind.
IN_GROUPS = {(0, 4): "crash", (1, 7): "crash", (2, 3): "poison", (3, 8): "poison", (4, 2): "long"}


def connect(url):
    params = pika.URLParameters(url)
    params.socket_timeout = 10
    params.blocked_connection_timeout = 10
    params.connection_attempts = 3
    params.retry_delay = 0.2
    return pika.BlockingConnection(params)


# ------------------------------------------------------------------------------------------------ the worker


def worker_main(url, queue, outdir, name, driver_pid):
    fd = os.open(os.path.join(outdir, f"events-{name}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(ev, **fields):
        """One event, written at once with one write(2): it survives an os._exit right after."""
        t = time.monotonic()
        fields.update(ev=ev, w=name, t=t)
        os.write(fd, (json.dumps(fields) + "\n").encode())
        return t

    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_qos(prefetch_count=PREFETCH)
    held = collections.deque()  # deliveries received and not started yet: (tag, info, job)
    stats = {"held_ext": 0}

    def extend(tag, ms):
        """True if the broker granted the extension (a confirm ack), False if it refused it (a nack)."""
        try:
            ch.basic_publish(
                VIS_EXCHANGE,
                "",
                b"",
                pika.BasicProperties(headers={"x-delivery-tag": tag, "x-visibility-timeout": ms}),
            )
            return True
        except NackError:
            return False

    def on_message(_ch, method, props, body):
        h = props.headers or {}
        job = json.loads(body)
        info = dict(job=job["id"], kind=job["kind"], group=job.get("group"), seq=job.get("seq"),
                    tag=method.delivery_tag, dc=h.get("x-delivery-count", 0), redelivered=method.redelivered)
        log("recv", **info)
        held.append((method.delivery_tag, info, job))

    def work_for(seconds, own_tag=None):
        """Works for `seconds` with a heartbeat every EXTEND_EVERY s: extends `own_tag` (the running job's
        delivery, if given) by EXTEND_MS each time, and every delivery waiting in the prefetch buffer by CLAIM_MS
        when it arrives and every HELD_EVERY s after. Without that the waiting deliveries would time out one after
        the other: each timeout gives the consumer its prefetch slot back, the broker fills it at once, and every
        job that lands behind a long one loses a try. Returns (extensions of own_tag, refusals)."""
        start = time.monotonic()
        until = start + seconds
        tick = start
        own, refused = 0, 0
        last = {}  # held tag -> when it was last extended
        while True:
            tick += EXTEND_EVERY
            now = time.monotonic()
            tick = max(tick, now)  # after a hiccup, the next beat goes out at once
            if tick >= until:
                time.sleep(max(0.0, until - now))
                return own, refused
            time.sleep(tick - now)
            if own_tag is not None:
                own += 1
                sent = time.monotonic()
                ok = extend(own_tag, EXTEND_MS)
                log("ext", tag=own_tag, ok=ok, sent=sent)
                if not ok:
                    refused += 1
            conn.process_data_events(time_limit=0)  # deliveries that arrived meanwhile join `held`
            for tag, _, _ in list(held):
                if time.monotonic() - last.get(tag, -1e9) < HELD_EVERY:
                    continue
                stats["held_ext"] += 1
                sent = time.monotonic()
                last[tag] = sent
                ok = extend(tag, CLAIM_MS)
                log("ext", tag=tag, ok=ok, sent=sent, held=True)

    def run(tag, info, job):
        kind = info["kind"]
        # The claim: CLAIM_MS for most jobs; EXTEND_MS for a long job (its extensions keep it); one visibility
        # timeout for a stall job (it lets that run out).
        sent = time.monotonic()
        claimed = extend(tag, {"long": EXTEND_MS, "stall": VISIBILITY_MS}.get(kind, CLAIM_MS))
        log("ext", tag=tag, ok=claimed, sent=sent, claim=True)
        if not claimed:
            log("skip", **info)  # timed out before it started: already back in the queue
            return
        log("start", **info)
        first = False
        if kind in ("crash", "stall"):
            try:
                os.close(os.open(os.path.join(outdir, f"first-{info['job']}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                first = True
            except FileExistsError:
                pass  # the second time it works
        if kind == "crash" and first:
            log("end", outcome="crash", **info)
            os._exit(CRASH_EXIT)  # no ack, no close: the broker sees the connection drop
        if kind == "poison":
            time.sleep(0.002)
            log("end", outcome="nack", **info)
            ch.basic_nack(tag, requeue=True)
            return
        extensions, refused = 0, 0
        if kind == "long":
            extensions, refused = work_for(LONG_MS / 1000, own_tag=tag)
        elif kind == "stall" and first:
            work_for(STALL_MS / 1000)  # lets its own delivery time out, then acks late
        else:
            time.sleep(job["ms"] / 1000)
        log("end", outcome="done", ext=extensions, refused=refused, late=kind == "stall" and first, **info)
        ch.basic_ack(tag)

    ctag = ch.basic_consume(queue, on_message)
    log("ready")
    stop = os.path.join(outdir, "stop")
    while not os.path.exists(stop) and os.getppid() == driver_pid:
        conn.process_data_events(time_limit=0 if held else 0.05)
        while held:
            run(*held.popleft())
    ch.basic_cancel(ctag)
    conn.close()
    log("stopped", held_ext=stats["held_ext"])
    return 0


# ------------------------------------------------------------------------------------------------ the driver


def make_jobs(rng):
    """The jobs in publish order; a group's sequence numbers follow its publish order."""
    slots = ["plain"] * N_PLAIN + ["crash"] * N_CRASH + ["long"] * N_LONG + ["poison"] * N_POISON
    slots += ["stall"] * N_STALL
    slots += [("group", g) for g in range(N_GROUPS) for _ in range(GROUP_SIZE)]
    rng.shuffle(slots)
    seqs = [0] * N_GROUPS
    jobs = []
    for i, slot in enumerate(slots):
        job = {"id": f"j{i:03d}", "ms": rng.randint(2, 10)}
        if isinstance(slot, tuple):
            g = slot[1]
            job.update(group=f"g{g}", seq=seqs[g], kind=IN_GROUPS.get((g, seqs[g]), "plain"))
            seqs[g] += 1
        else:
            job["kind"] = slot
        jobs.append(job)
    return jobs


class Pool:
    def __init__(self, url, queue, outdir):
        self.url, self.queue, self.outdir = url, queue, outdir
        self.procs = {}  # slot -> (name, Popen, stderr file)
        self.gens = [0] * WORKERS
        self.crashes = 0
        self.unexpected = []  # (name, exit code, stderr tail)

    def spawn(self, slot):
        name = f"w{slot}.{self.gens[slot]}"
        self.gens[slot] += 1
        err = open(os.path.join(self.outdir, f"{name}.stderr"), "wb")
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", self.url, self.queue, self.outdir, name,
             str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err,
        )
        self.procs[slot] = (name, p, err)

    def start(self):
        for slot in range(WORKERS):
            self.spawn(slot)

    def supervise(self):
        """Restarts the workers that exited (a crash on purpose, or anything else: that is noted)."""
        for slot, (name, p, err) in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            err.close()
            if rc == CRASH_EXIT:
                self.crashes += 1
            else:
                self.unexpected.append((name, rc, tail(os.path.join(self.outdir, f"{name}.stderr"))))
            self.spawn(slot)

    def stop(self, timeout=5.0):
        self.supervise()
        open(os.path.join(self.outdir, "stop"), "w").close()
        deadline = time.monotonic() + timeout
        for slot, (name, p, err) in self.procs.items():
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
                if rc != 0:
                    self.unexpected.append((name, rc, tail(os.path.join(self.outdir, f"{name}.stderr"))))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self.unexpected.append((name, "did not stop (killed)", tail(os.path.join(self.outdir, f"{name}.stderr"))))
            err.close()

    def kill_all(self):
        for _, p, _ in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def tail(path, n=1500):
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


class Events:
    """Reads the workers' event files as they grow."""

    def __init__(self, outdir):
        self.outdir = outdir
        self.offsets = {}
        self.all = []

    def poll(self):
        new = []
        for fname in sorted(os.listdir(self.outdir)):
            if not fname.startswith("events-"):
                continue
            path = os.path.join(self.outdir, fname)
            with open(path, "rb") as f:
                f.seek(self.offsets.get(fname, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self.offsets[fname] = self.offsets.get(fname, 0) + end
            for line in data[:end].splitlines():
                if line.strip():
                    new.append(json.loads(line))
        self.all.extend(new)
        return new


def text(v):
    return v.decode() if isinstance(v, bytes) else v


def check(jobs, events, dead, queue_state, pool, queue):
    """Every failed expectation, as lines."""
    fails = []
    by_id = {j["id"]: j for j in jobs}
    poison = {j["id"] for j in jobs if j["kind"] == "poison"}
    evs = sorted(events, key=lambda e: e["t"])
    done, starts, recvs = {}, {}, {}
    for e in evs:
        if e["ev"] == "end" and e["outcome"] == "done":
            done.setdefault(e["job"], []).append(e)
        elif e["ev"] == "start":
            starts.setdefault(e["job"], []).append(e)
        elif e["ev"] == "recv":
            recvs.setdefault(e["job"], []).append(e)

    # Every job but the poison ones done at least once; poison ones never.
    missing = sorted(j for j in by_id if j not in poison and j not in done)
    if missing:
        fails.append(f"{len(missing)} jobs never done: " + ", ".join(
            f"{j} ({by_id[j]['kind']}, {len(recvs.get(j, []))} deliveries, {len(starts.get(j, []))} starts)"
            for j in missing[:20]))
    for j in sorted(poison & set(done)):
        fails.append(f"poison job {j} was done: {done[j]}")

    # The dead-letter queue: each poison job once, reason delivery_limit, nothing else.
    seen = {}
    for jid, deaths in dead:
        seen[jid] = seen.get(jid, 0) + 1
        if jid not in poison:
            kind = by_id[jid]["kind"] if jid in by_id else "?"
            fails.append(f"dead-lettered job {jid} ({kind}) is not a poison job: x-death {deaths}, "
                         f"deliveries {[(e['w'], e['dc']) for e in recvs.get(jid, [])]}")
            continue
        if not deaths:
            fails.append(f"poison job {jid} in the DLQ without x-death")
            continue
        first = deaths[0]
        reason, q = text(first.get("reason")), text(first.get("queue"))
        if reason != "delivery_limit" or q != queue:
            fails.append(f"poison job {jid}: x-death reason {reason!r}, queue {q!r} (expected delivery_limit, {queue})")
    for j in sorted(poison):
        if seen.get(j, 0) != 1:
            fails.append(f"poison job {j} is in the DLQ {seen.get(j, 0)} times "
                         f"(deliveries: {[(e['w'], e['dc']) for e in recvs.get(j, [])]})")

    # Long jobs: started once, done once, all extensions granted, never delivered again once started.
    for j in sorted(x for x in by_id if by_id[x]["kind"] == "long"):
        st, dn = starts.get(j, []), done.get(j, [])
        if len(st) != 1 or len(dn) != 1:
            fails.append(f"long job {j}: {len(st)} starts and {len(dn)} completions (expected 1 and 1): "
                         f"deliveries {[(e['w'], e['dc'], round(e['t'], 3)) for e in recvs.get(j, [])]}")
            continue
        s, d = st[0], dn[0]
        if s["w"] != d["w"] or s["tag"] != d["tag"]:
            fails.append(f"long job {j} started by {s['w']} tag {s['tag']} but done by {d['w']} tag {d['tag']}")
        if d["refused"]:
            fails.append(f"long job {j}: {d['refused']} of {d['ext']} extensions refused")
        if d["ext"] < LONG_MS // EXTEND_MS:
            fails.append(f"long job {j}: only {d['ext']} extensions")
        if d["t"] - s["t"] < 3 * VISIBILITY_MS / 1000:
            fails.append(f"long job {j} ran {d['t'] - s['t']:.3f} s, not several visibility timeouts")
        later = [e for e in recvs.get(j, []) if e["t"] > s["t"]]
        if later:
            fails.append(f"long job {j} (started by {s['w']} at {s['t']:.3f}) was delivered again while or after "
                         f"it ran: {[(e['w'], e['dc'], round(e['t'], 3)) for e in later]}")

    # Stall jobs: the first run let its delivery time out and acked late. Either the broker delivered the job
    # again meanwhile (when a worker had a free prefetch slot), and the late ack must not settle that copy: it
    # is done again; or it was still waiting in the queue, and the late ack settled it: never delivered again.
    for j in sorted(x for x in by_id if by_id[x]["kind"] == "stall"):
        late = [e for e in done.get(j, []) if e.get("late")]
        if len(late) != 1:
            fails.append(f"stall job {j}: {len(late)} stalled runs (expected 1)")
            continue
        copies = [e for e in starts.get(j, []) if (e["w"], e["tag"]) != (late[0]["w"], late[0]["tag"])]
        if len(done.get(j, [])) != 1 + len(copies):
            fails.append(f"stall job {j}: done {len(done.get(j, []))} times, started again "
                         f"{[(e['w'], e['dc']) for e in copies]}")

    # Crash jobs: crashed once each, then done.
    crashed = [e for e in evs if e["ev"] == "end" and e["outcome"] == "crash"]
    ncrash = sum(1 for j in jobs if j["kind"] == "crash")
    if len(crashed) != ncrash or len({e["job"] for e in crashed}) != ncrash:
        fails.append(f"{len(crashed)} crashes of {len({e['job'] for e in crashed})} jobs (expected {ncrash})")
    if pool.crashes != len(crashed):
        fails.append(f"{pool.crashes} workers exited with the crash code, {len(crashed)} crashes logged")

    # Groups: attempts never overlap; first completions (and first starts) in sequence order.
    intervals = {}  # group -> [(start, end, job, seq, worker, outcome)]
    open_starts = {}
    for e in evs:
        if e.get("group") is None or e["ev"] not in ("start", "end"):
            continue
        key = (e["w"], e["tag"])
        if e["ev"] == "start":
            open_starts[key] = e
        else:
            s = open_starts.pop(key, None)
            if s is None:
                fails.append(f"end without start: {e}")
                continue
            intervals.setdefault(e["group"], []).append((s["t"], e["t"], e["job"], e["seq"], e["w"], e["outcome"]))
    for s in open_starts.values():
        fails.append(f"group job {s['job']} started by {s['w']} at {s['t']:.3f} never ended")
    order_fails = overlap_fails = 0
    for g in sorted(intervals):
        iv = sorted(intervals[g])
        for a, b in zip(iv, iv[1:]):
            if b[0] < a[1]:
                overlap_fails += 1
                if overlap_fails <= 10:
                    fails.append(f"group {g}: {b[2]} (seq {b[3]}, {b[4]}) started at {b[0]:.4f} while {a[2]} "
                                 f"(seq {a[3]}, {a[4]}, {a[5]}) ran until {a[1]:.4f}")
        firsts = sorted(
            (min(e["t"] for e in done[j["id"]]), j["seq"], j["id"])
            for j in jobs if j.get("group") == g and j["id"] in done
        )
        seq_order = [s for _, s, _ in firsts]
        if seq_order != sorted(seq_order):
            order_fails += 1
            fails.append(f"group {g}: first completions in order of sequence {seq_order}")
        first_starts = sorted(min(e["t"] for e in starts[j["id"]]) for j in jobs
                              if j.get("group") == g and j["id"] in starts)
        by_seq = [min(e["t"] for e in starts[j["id"]]) for j in sorted(
            (j for j in jobs if j.get("group") == g and j["id"] in starts), key=lambda j: j["seq"])]
        if by_seq != first_starts:
            order_fails += 1
            fails.append(f"group {g}: first starts not in sequence order")
    if overlap_fails > 10:
        fails.append(f"... {overlap_fails} overlaps in all")

    # The work queue once the workers are gone.
    count, consumers = queue_state
    if count != 0 or consumers != 0:
        fails.append(f"work queue at the end: {count} messages, {consumers} consumers (expected 0 and 0)")

    for name, rc, err in pool.unexpected:
        fails.append(f"worker {name} exited with {rc}: {err}")
    return fails


def main(url):
    t0 = time.monotonic()
    outdir = tempfile.mkdtemp(prefix="warren-pool-")
    uid = uuid.uuid4().hex[:10]
    queue, dlx, dlq = f"pool-{uid}", f"pool-{uid}.dlx", f"pool-{uid}.dlq"
    pool = Pool(url, queue, outdir)
    conn = None
    try:
        conn = connect(url)
        ch = conn.channel()
        ch.exchange_declare(dlx, "fanout", durable=True)
        ch.queue_declare(dlq, durable=True)
        ch.queue_bind(dlq, dlx)
        ch.queue_declare(queue, durable=True, arguments={
            "x-visibility-timeout": VISIBILITY_MS,
            "x-delivery-limit": DELIVERY_LIMIT,
            "x-dead-letter-exchange": dlx,
            "x-delayed-retry-min": RETRY_MIN_MS,
            "x-group-header": GROUP_HEADER,
        })
        jobs = make_jobs(random.Random(20240607))
        pool.start()
        ch.confirm_delivery()
        for job in jobs:
            headers = {"x-job-id": job["id"], "x-kind": job["kind"]}
            if "group" in job:
                headers[GROUP_HEADER] = job["group"]
                headers["x-seq"] = job["seq"]
            # Blocks until the broker confirms it; raises on a nack.
            ch.basic_publish("", queue, json.dumps(job).encode(),
                             pika.BasicProperties(delivery_mode=2, headers=headers, message_id=job["id"]))
        published = time.monotonic()

        events = Events(outdir)
        need = {j["id"] for j in jobs if j["kind"] != "poison"}
        npoison = len(jobs) - len(need)
        done = set()
        dlq_count = 0
        next_dlq_check = 0.0
        while True:
            pool.supervise()
            for e in events.poll():
                if e["ev"] == "end" and e["outcome"] == "done":
                    done.add(e["job"])
            now = time.monotonic()
            if now >= next_dlq_check:
                dlq_count = ch.queue_declare(dlq, passive=True).method.message_count
                next_dlq_check = now + 0.1
            if need <= done and dlq_count >= npoison:
                break
            if now - t0 > DEADLINE:
                q = ch.queue_declare(queue, passive=True).method
                print(f"FAIL: after {DEADLINE:.0f} s, {len(need - done)} jobs not done "
                      f"({sorted(need - done)[:20]}), {dlq_count} of {npoison} poison jobs dead-lettered; work "
                      f"queue: {q.message_count} messages, {q.consumer_count} consumers", flush=True)
                pool.supervise()
                events.poll()
                dump_tail(events.all, pool)
                return 1
            conn.process_data_events(time_limit=0.02)
        all_through = time.monotonic()

        pool.stop()
        # The workers' connections are closed; the broker may take a moment to drop their consumers.
        deadline = time.monotonic() + 3
        while True:
            q = ch.queue_declare(queue, passive=True).method
            if q.consumer_count == 0 or time.monotonic() > deadline:
                break
            conn.process_data_events(time_limit=0.02)
        queue_state = (q.message_count, q.consumer_count)

        dead = []
        while True:
            method, props, body = ch.basic_get(dlq, auto_ack=True)
            if method is None:
                break
            h = props.headers or {}
            dead.append((text(h.get("x-job-id")), h.get("x-death") or []))
        events.poll()
        fails = check(jobs, events.all, dead, queue_state, pool, queue)
        ch.queue_delete(queue)
        ch.queue_delete(dlq)
        ch.exchange_delete(dlx)
        conn.close()
        conn = None

        if fails:
            for f in fails:
                print(f"FAIL: {f}", flush=True)
            return 1
        ends = [e for e in events.all if e["ev"] == "end" and e["outcome"] == "done"]
        dup = len(ends) - len({e["job"] for e in ends})
        skips = sum(1 for e in events.all if e["ev"] == "skip")
        stall_starts = collections.Counter(e["job"] for e in events.all if e["ev"] == "start" and e["kind"] == "stall")
        stall_again = sum(1 for n in stall_starts.values() if n > 1)
        redelivered = sum(1 for e in events.all if e["ev"] == "recv" and e["dc"])
        ext = sum(e["ext"] for e in ends)
        kinds = {}
        for j in jobs:
            kinds[j["kind"]] = kinds.get(j["kind"], 0) + 1
        print(f"ok - worker pool: {len(jobs)} jobs ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}; "
              f"{N_GROUPS} groups of {GROUP_SIZE}) through {WORKERS} workers; {len(ends)} completions "
              f"({dup} repeated), {pool.crashes} crashes and restarts, {redelivered} redeliveries, {skips} timed-out "
              f"deliveries skipped, {ext} extensions of long jobs, {stall_again} of {kinds.get('stall', 0)} stalled jobs "
              f"delivered again after their timeout (the others settled by their late ack), {len(dead)} poison jobs dead-lettered "
              f"(delivery_limit), groups in order without overlap; published in {published - t0:.2f} s, all "
              f"through in {all_through - t0:.2f} s, total {time.monotonic() - t0:.2f} s", flush=True)
        return 0
    finally:
        pool.kill_all()
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already failing
                pass
        if os.environ.get("WARREN_POOL_KEEP"):
            print(f"(events kept in {outdir})", flush=True)
        else:
            shutil.rmtree(outdir, ignore_errors=True)


def dump_tail(events, pool):
    """What each worker did last, for a failure report."""
    by_w = {}
    for e in sorted(events, key=lambda e: e["t"]):
        by_w.setdefault(e["w"], []).append(e)
    for w, evs in sorted(by_w.items()):
        print(f"  {w}: last events {evs[-4:]}", flush=True)
    for name, rc, err in pool.unexpected:
        print(f"  worker {name} exited with {rc}: {err}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, w_url, w_queue, w_outdir, w_name, w_driver = sys.argv
        sys.exit(worker_main(w_url, w_queue, w_outdir, w_name, int(w_driver)))
    URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "WARREN_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    sys.exit(main(URL))
