#!/usr/bin/env python3
"""Celery against the broker under test, the way a Celery application uses RabbitMQ: `amqp://` broker URL
(py-amqp through kombu), a worker run as its own process (`celery worker`, prefork pool of 2), and a result backend
that needs no other server (SQLAlchemy on a SQLite file in a temporary directory).

Usage: python3 celery_flows.py amqp://guest:guest@127.0.0.1:5672/%2f [flow-prefix ...]

With prefixes, runs only the flows whose names start with one of them (the worker flows always run). Prints one
"ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" and the tail of the worker's log on the
first failure.

This file is also the Celery app the worker imports (`celery -A celery_flows worker`): the driver passes the
broker URL, result backend, queue name and scratch directory to it in WARREN_CELERY_* environment variables.
Celery's defaults are kept except where a flow needs otherwise: prefetch multiplier 1 (so two ETA tasks fill the
worker's window and a third task only gets through if the broker honours the worker's raised prefetch), and a
chord retry interval of 0.25 s instead of 1 s.
"""

import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    # The driver: choose the broker, a fresh queue and a scratch directory before the app below reads them.
    _url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "WARREN_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"
    )
    _scratch = tempfile.mkdtemp(prefix="warren-celery-")
    os.environ["WARREN_CELERY_BROKER"] = _url
    os.environ["WARREN_CELERY_DIR"] = _scratch
    os.environ["WARREN_CELERY_BACKEND"] = f"db+sqlite:///{_scratch}/results.sqlite"
    os.environ["WARREN_CELERY_QUEUE"] = f"celery-warren-{uuid.uuid4().hex[:12]}"
    os.environ["WARREN_CELERY_DRIVER_PID"] = str(os.getpid())

try:
    from celery import Celery, chord, group
    from celery.exceptions import TimeoutError as CeleryTimeoutError
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import celery: {e} (scripts/test installs it into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

BROKER = os.environ.get("WARREN_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2f")
SCRATCH = os.environ.get("WARREN_CELERY_DIR", tempfile.gettempdir())
QUEUE = os.environ.get("WARREN_CELERY_QUEUE", "celery-warren")

app = Celery("warren_flows", broker=BROKER, backend=os.environ.get("WARREN_CELERY_BACKEND"))
app.conf.update(
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_timeout=5,
    # The driver and the worker share the SQLite file; each opens its own short sessions.
    database_short_lived_sessions=True,
    # A chord on this backend is joined by celery.chord_unlock, which polls (an ETA retry) at this interval.
    result_chord_retry_interval=0.25,
)


def _watch_driver(driver_pid):
    """In a worker: when the driver is gone (killed by the test's timeout), take the worker's process group
    (the worker and its pool) down with it, rather than leave it retrying a broker that no longer exists."""
    while True:
        time.sleep(0.25)
        if os.getppid() != driver_pid:  # the driver started this worker; orphaned now
            os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ != "__main__" and os.environ.get("WARREN_CELERY_DRIVER_PID"):
    threading.Thread(target=_watch_driver, args=(int(os.environ["WARREN_CELERY_DRIVER_PID"]),), daemon=True).start()


def _append(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path):
    try:
        with open(path) as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError:
        return []


@app.task(name="warren.add")
def add(x, y):
    return x + y


@app.task(name="warren.tsum")
def tsum(xs):
    return sum(xs)


@app.task(name="warren.boom")
def boom(text):
    raise ValueError(text)


@app.task(name="warren.stamp")
def stamp(tag):
    """When the worker started running this task (wall clock: the driver runs on the same machine)."""
    return {"tag": tag, "started": time.time()}


@app.task(name="warren.flaky", bind=True, max_retries=5)
def flaky(self, key, fail_times):
    """Fails (with self.retry, countdown 1 s) the first `fail_times` times it runs."""
    _append(os.path.join(SCRATCH, key), repr(time.time()))
    if self.request.retries < fail_times:
        raise self.retry(countdown=1)
    return {"retries": self.request.retries, "times": [float(t) for t in _lines(os.path.join(SCRATCH, key))]}


@app.task(name="warren.fragile", bind=True, acks_late=True)
def fragile(self, key):
    """acks_late: the first run signals the driver and hangs until the worker is killed; the next run returns."""
    runs = os.path.join(SCRATCH, key + ".runs")
    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    _append(runs, f"{self.request.hostname} {redelivered}")
    started = os.path.join(SCRATCH, key + ".started")
    if not os.path.exists(started):
        _append(started, self.request.hostname)
        time.sleep(60)  # the driver SIGKILLs this worker long before
    return {"runs": _lines(runs)}


# ---------------------------------------------------------------------------------------------------- driver

WAIT = 15.0
# ETA slack: the ETA travels as an ISO 8601 string with microseconds, and the worker's timer compares wall
# clock times in floats; anything earlier than this is a real early delivery.
EARLY_SLACK = 0.005


class Worker:
    """One `celery worker --pool=prefork --concurrency=2` process group, its log in the scratch directory."""

    count = 0

    def __init__(self):
        Worker.count += 1
        self.name = f"w{Worker.count}"
        self.hostname = f"{self.name}-{uuid.uuid4().hex[:6]}@warren-test"
        self.log_path = os.path.join(SCRATCH, f"worker-{self.name}.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ)
        env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "celery_flows", "worker",
                "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "--hostname", self.hostname,
                "--without-mingle",  # no other workers to sync with: saves a 1 s wait per start
            ],
            cwd=HERE, env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() takes the pool's children with it
        )

    def wait_ready(self):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.proc.returncode} before it was ready")
            if " ready." in _read(self.log_path):
                return
            time.sleep(0.05)
        raise AssertionError(f"worker {self.name} not ready after {WAIT} s")

    def kill(self):
        """SIGKILL to the worker and its pool processes at once (as the OOM killer or a container stop)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=WAIT)

    def stop(self):
        """Warm shutdown (SIGTERM): the worker finishes, closes its broker connection and exits 0."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"worker {self.name} did not stop within {WAIT} s of SIGTERM")

    def tail(self, n=60):
        return "\n".join(_read(self.log_path).splitlines()[-n:])


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def get(result, what):
    try:
        return result.get(timeout=WAIT, interval=0.05)
    except CeleryTimeoutError:
        raise AssertionError(f"{what}: no result within {WAIT} s (state {result.state})") from None


FLOWS = []


def flow(name):
    def register(fn):
        FLOWS.append((name, fn))
        return fn

    return register


state = {"workers": []}


def start_worker():
    w = Worker()
    state["workers"].append(w)
    w.wait_ready()
    state["worker"] = w
    return w


@flow("worker: start and wait until ready")
def _start():
    # Create the result tables before two processes race to do it.
    app.backend.ResultSession().close()
    start_worker()


@flow("tasks: results come back")
def _plain():
    results = [add.delay(i, i * 10) for i in range(10)]
    values = [get(r, f"add #{i}") for i, r in enumerate(results)]
    assert values == [i * 11 for i in range(10)], values
    assert all(r.state == "SUCCESS" for r in results), [r.state for r in results]
    failed = boom.delay("expected failure")
    try:
        failed.get(timeout=WAIT, interval=0.05)
        raise AssertionError("a task that raises must fail")
    except ValueError as e:
        assert str(e) == "expected failure", e
    assert failed.state == "FAILURE", failed.state


@flow("eta: countdown and eta tasks run no earlier than asked")
def _eta():
    t0 = time.time()
    by_countdown = stamp.apply_async(("countdown",), countdown=1)
    eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=1.5)
    by_eta = stamp.apply_async(("eta",), eta=eta)
    r_cd = get(by_countdown, "countdown=1 task")
    r_eta = get(by_eta, "eta=+1.5 s task")
    assert r_cd["started"] >= t0 + 1.0 - EARLY_SLACK, f"countdown=1 task ran after {r_cd['started'] - t0:.3f} s"
    assert r_cd["started"] < t0 + 1.0 + 5.0, f"countdown=1 task ran late: {r_cd['started'] - t0:.3f} s"
    assert r_eta["started"] >= eta.timestamp() - EARLY_SLACK, (
        f"eta task ran {eta.timestamp() - r_eta['started']:.3f} s early"
    )
    assert r_eta["started"] < eta.timestamp() + 5.0, f"eta task ran late: {r_eta['started'] - eta.timestamp():.3f}"
    print(f"   countdown=1 ran at +{r_cd['started'] - t0:.3f} s, eta=+1.5 at +{r_eta['started'] - t0:.3f} s",
          flush=True)


@flow("prefetch: tasks waiting for their ETA do not hold up other tasks")
def _eta_prefetch():
    # The worker's prefetch is 2 (concurrency 2, multiplier 1). It holds an ETA task's message unacked until the
    # ETA and raises its prefetch with basic.qos for each one it holds (kombu sends global=True to RabbitMQ 3.x,
    # global=False to a broker whose product is not RabbitMQ). A task sent after two ETA tasks only reaches the
    # worker before their ETA if the broker applies the raised limit to the worker's running consumer.
    t0 = time.time()
    waiting = [stamp.apply_async((f"eta-{i}",), countdown=1) for i in range(2)]
    now = stamp.delay("now")
    r_now = get(now, "a plain task sent after two ETA tasks")
    r_waiting = [get(r, "countdown=1 task") for r in waiting]
    first_eta = min(r["started"] for r in r_waiting)
    print(f"   plain task ran at +{r_now['started'] - t0:.3f} s, the ETA tasks from +{first_eta - t0:.3f} s",
          flush=True)
    assert r_now["started"] < t0 + 1.0 and r_now["started"] < first_eta, (
        f"a plain task waited {r_now['started'] - t0:.2f} s, behind two ETA tasks (due at +1 s): "
        "the worker's raised prefetch (basic.qos) did not reach its consumer"
    )


@flow("retry: self.retry(countdown=1) twice, then success")
def _retry():
    key = f"flaky-{uuid.uuid4().hex[:8]}"
    r = flaky.delay(key, 2)
    value = get(r, "a task retried twice")
    assert value["retries"] == 2, value
    times = value["times"]
    assert len(times) == 3, f"expected 3 runs (2 retries), got {len(times)}: {times}"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 1.0 - EARLY_SLACK for g in gaps), f"retry countdown=1 not respected, gaps {gaps}"
    assert r.state == "SUCCESS", r.state
    print(f"   gaps between runs: {', '.join(f'{g:.3f} s' for g in gaps)}", flush=True)


@flow("acks_late: a task whose worker is SIGKILLed runs again in a new worker")
def _acks_late():
    key = f"fragile-{uuid.uuid4().hex[:8]}"
    r = fragile.delay(key)
    started = os.path.join(SCRATCH, key + ".started")
    deadline = time.monotonic() + WAIT
    while not os.path.exists(started):
        if time.monotonic() > deadline:
            raise AssertionError("the acks_late task never started")
        time.sleep(0.02)
    victim = state["worker"]
    victim.kill()
    assert r.state == "PENDING", f"the killed task must have no result yet, state {r.state}"
    start_worker()
    value = get(r, "the acks_late task after its worker was killed")
    runs = [line.split() for line in value["runs"]]
    assert len(runs) == 2, f"expected exactly 2 runs, got {value['runs']}"
    assert [r[0] for r in runs] == [victim.hostname, state["worker"].hostname], f"runs (worker, redelivered): {runs}"
    assert [r[1] for r in runs] == ["False", "True"], f"redelivered flags (first, second run): {runs}"


@flow("canvas: a group of 10 and a chord of 5")
def _canvas():
    g = group(add.s(i, i) for i in range(10))()
    try:
        values = g.get(timeout=WAIT, interval=0.05)
    except CeleryTimeoutError:
        raise AssertionError(f"group: no result within {WAIT} s") from None
    assert values == [2 * i for i in range(10)], values
    c = chord(add.s(i, 100) for i in range(5))(tsum.s())
    assert get(c, "chord (header of 5 adds, tsum body)") == 510, c.result


@flow("worker: warm shutdown on SIGTERM")
def _stop():
    w = state["worker"]
    code = w.stop()
    assert code == 0, f"worker exited with {code} after SIGTERM"


def cleanup():
    for w in state["workers"]:
        if w.proc.poll() is None:
            w.kill()
    try:
        with app.connection_for_write() as conn:
            ch = conn.default_channel
            ch.queue_delete(QUEUE)
            ch.exchange_delete(QUEUE)
    except Exception as e:  # noqa: BLE001 - only tidying a shared broker
        print(f"(cleanup: {e!r})", file=sys.stderr)
    shutil.rmtree(SCRATCH, ignore_errors=True)


def main():
    only = sys.argv[2:]
    flows = [
        (name, fn) for name, fn in FLOWS
        if not only or name.startswith("worker:") or any(name.startswith(p) for p in only)
    ]
    current = "(start)"
    t_start = time.monotonic()
    try:
        for name, fn in flows:
            current = name
            t = time.monotonic()
            fn()
            print(f"ok - {name} ({time.monotonic() - t:.2f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - report any failure
        print(f"FAIL: {current}: {e}", file=sys.stderr)
        traceback.print_exc()
        for w in state["workers"]:
            print(f"---- worker {w.name} log (last lines) ----\n{w.tail()}", file=sys.stderr)
        cleanup()
        return 1
    cleanup()
    print(f"celery flows: {time.monotonic() - t_start:.1f} s")
    print(f"celery: {len(flows)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
