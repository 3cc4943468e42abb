#!/usr/bin/env python3
"""Celery on its SQS transport (kombu's sqs://, which speaks SQS through boto3 and pycurl), unchanged, against
Warren's SQS endpoint: tasks and results, a worker that dies mid-task (its task runs again once the visibility
timeout passes), and a poison task that kills its worker until the queue's redrive policy moves it to the
dead-letter queue, from where a message move task sends it back once it is fixed.

Usage: python3 celery_sqs_flows.py http://127.0.0.1:9324

The worker is `celery worker --pool=solo` in a process of its own, so a task's os._exit() is the worker dying, as
a machine would. Results go to SQLite through SQLAlchemy (no other server). This file is also the Celery app the
worker imports; the driver passes the endpoint, queue names and scratch directory in WARREN_CELERY_* variables.
Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" and the tail of the worker's
log on the first failure.
"""

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    _endpoint = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:9324"
    _scratch = tempfile.mkdtemp(prefix="warren-celery-sqs-")
    _name = f"celery-sqs-{uuid.uuid4().hex[:12]}"
    os.environ["WARREN_CELERY_ENDPOINT"] = _endpoint
    os.environ["WARREN_CELERY_DIR"] = _scratch
    os.environ["WARREN_CELERY_QUEUE"] = _name
    os.environ["WARREN_CELERY_POISON_QUEUE"] = f"{_name}-poison"

try:
    import boto3
    from celery import Celery
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import: {e} (scripts/test installs celery, boto3 and pycurl into clients/.deps/python)",
          file=sys.stderr)
    sys.exit(2)

ENDPOINT = os.environ.get("WARREN_CELERY_ENDPOINT", "http://127.0.0.1:9324")
SCRATCH = os.environ.get("WARREN_CELERY_DIR", tempfile.gettempdir())
QUEUE = os.environ.get("WARREN_CELERY_QUEUE", "celery-sqs")
POISON_QUEUE = os.environ.get("WARREN_CELERY_POISON_QUEUE", "celery-sqs-poison")
# Seconds a received message stays invisible: short, so that a dead worker's task comes back soon.
VISIBILITY = 2
WAIT = 60

# guest/guest: a Warren user's name and password are an access key id and its secret.
app = Celery(
    "warren_sqs_flows",
    broker=f"sqs://guest:guest@{ENDPOINT.split('://', 1)[1]}",
    backend=f"db+sqlite:///{SCRATCH}/results.sqlite",
)
app.conf.update(
    task_default_queue=QUEUE,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "region": "us-east-1",
        "visibility_timeout": VISIBILITY,
        "polling_interval": 0.1,
        "wait_time_seconds": 1,
    },
    database_short_lived_sessions=True,
)


@app.task(name="warren_sqs.add")
def add(x, y):
    return x + y


@app.task(name="warren_sqs.crash_once")
def crash_once(marker):
    """The first run kills its worker mid-task; the run after the visibility timeout succeeds."""
    path = os.path.join(SCRATCH, marker)
    if not os.path.exists(path):
        open(path, "w").close()
        os._exit(1)
    return "survived"


@app.task(name="warren_sqs.poison")
def poison(marker):
    """Kills its worker until the marker file exists (the bug is fixed)."""
    if not os.path.exists(os.path.join(SCRATCH, marker)):
        os._exit(1)
    return "fixed"


def sqs():
    return boto3.client(
        "sqs", endpoint_url=ENDPOINT, region_name="us-east-1", aws_access_key_id="guest", aws_secret_access_key="guest"
    )


class Worker:
    """`celery worker --pool=solo` in its own process group, its log in the scratch directory."""

    def __init__(self):
        self.log_path = os.path.join(SCRATCH, f"worker-{uuid.uuid4().hex[:8]}.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "celery_sqs_flows", "worker", "--pool=solo",
                "--loglevel=INFO", "--without-mingle", "--without-gossip", "-Q", f"{QUEUE},{POISON_QUEUE}",
            ],
            cwd=HERE, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=WAIT)
        self.log.close()

    def tail(self):
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-30:])
        except OSError:
            return ""


workers = []


def worker():
    """The running worker: a new one when the last has died."""
    if not workers or not workers[-1].alive():
        if workers:
            workers[-1].kill()
        workers.append(Worker())
    return workers[-1]


def until(what, check, limit=WAIT):
    """Waits for check() to be true, keeping a worker running (a task may kill it)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        worker()
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def result_of(r, what):
    return until(what, lambda: r.ready() and [r.get(timeout=1)])[0]


FLOWS = []


def flow(f):
    FLOWS.append(f)
    return f


@flow
def tasks_and_results():
    worker()
    assert result_of(add.delay(2, 3), "add(2, 3)") == 5
    results = [add.delay(i, i) for i in range(20)]
    assert [result_of(r, "a batch of adds") for r in results] == [2 * i for i in range(20)]


@flow
def a_task_whose_worker_dies_runs_again_after_its_visibility_timeout():
    started = len(workers)
    r = crash_once.delay(f"crash-{uuid.uuid4().hex[:8]}")
    assert result_of(r, "the crashed task's second run") == "survived"
    assert len(workers) > started, "no worker died"


@flow
def a_poison_task_goes_to_the_dead_letter_queue_and_a_move_task_brings_it_back():
    c = sqs()
    dlq = c.create_queue(QueueName=f"{QUEUE}-dead")["QueueUrl"]
    dlq_arn = c.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    # The queue exists before Celery declares it (with the same visibility timeout, so kombu's CreateQueue
    # finds it as it asks): after two receives a message goes to the dead-letter queue.
    policy = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "2"})
    url = c.get_queue_url(QueueName=POISON_QUEUE)["QueueUrl"]
    c.set_queue_attributes(QueueUrl=url, Attributes={"RedrivePolicy": policy})
    marker = f"fixed-{uuid.uuid4().hex[:8]}"
    r = poison.apply_async((marker,), queue=POISON_QUEUE)

    def dead_letters():
        n = c.get_queue_attributes(QueueUrl=dlq, AttributeNames=["ApproximateNumberOfMessages"])
        return int(n["Attributes"]["ApproximateNumberOfMessages"]) == 1

    until("the poison task in the dead-letter queue", dead_letters)
    assert not r.ready(), "the poison task finished"
    open(os.path.join(SCRATCH, marker), "w").close()
    c.start_message_move_task(SourceArn=dlq_arn)
    assert result_of(r, "the redriven task") == "fixed"
    tasks = c.list_message_move_tasks(SourceArn=dlq_arn)["Results"]
    assert tasks[0]["Status"] == "COMPLETED" and tasks[0]["ApproximateNumberOfMessagesMoved"] == 1, tasks


def main():
    # Celery makes both queues at the first send; the poison queue is asked for now, as the worker will.
    c = sqs()
    c.create_queue(QueueName=POISON_QUEUE, Attributes={"VisibilityTimeout": str(VISIBILITY)})
    try:
        for f in FLOWS:
            try:
                f()
            except Exception as e:  # noqa: BLE001 - reported to the Rust test
                traceback.print_exc()
                print(f"FAIL: {f.__name__}: {e!r}", flush=True)
                if workers:
                    print("--- the worker's log:\n" + workers[-1].tail(), flush=True)
                sys.exit(1)
            print(f"ok - {f.__name__}", flush=True)
    finally:
        for w in workers:
            w.kill()
        for name in (QUEUE, POISON_QUEUE, f"{QUEUE}-dead"):
            try:
                c.delete_queue(QueueUrl=c.get_queue_url(QueueName=name)["QueueUrl"])
            except Exception:  # noqa: BLE001 - best effort
                pass
        shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
