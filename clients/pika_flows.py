#!/usr/bin/env python3
"""Core AMQP flows driven by pika (the Python client), used exactly as an application written for RabbitMQ
uses it. Usage: python3 pika_flows.py amqp://guest:guest@127.0.0.1:5672/%2f

Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" on the first failure.
"""

import os
import sys
import time
import traceback
import uuid

try:
    import pika
    from pika.exceptions import ChannelClosedByBroker, UnroutableError
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import pika: {e} (scripts/test installs it into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WARREN_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
QUIET = 0.3
WAIT = 10.0


def unique(prefix):
    return f"{prefix}-py-{uuid.uuid4().hex[:12]}"


def connect():
    params = pika.URLParameters(URL)
    params.socket_timeout = WAIT
    params.blocked_connection_timeout = WAIT
    return pika.BlockingConnection(params)


def get_one(ch, queue, auto_ack):
    """basic.get until a message arrives (publishes are asynchronous)."""
    deadline = time.monotonic() + WAIT
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        if time.monotonic() > deadline:
            raise AssertionError(f"no message in {queue}")
        time.sleep(0.005)


def pump(conn, until, what):
    """Processes I/O until until() is true."""
    deadline = time.monotonic() + WAIT
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        conn.process_data_events(time_limit=0.05)


FLOWS = []


def flow(name):
    def register(fn):
        FLOWS.append((name, fn))
        return fn

    return register


state = {}


@flow("connect and read server capabilities")
def _connect():
    conn = connect()
    state["conn"] = conn
    caps = conn._impl.server_capabilities  # what pika itself checks before using extensions
    for cap in ("publisher_confirms", "basic.nack", "consumer_cancel_notify", "authentication_failure_close"):
        assert caps.get(cap) is True, f"capability {cap}: {caps}"


@flow("declare queues (named and server-named)")
def _declare():
    ch = state["conn"].channel()
    name = unique("decl")
    ok = ch.queue_declare(name)
    assert ok.method.queue == name and ok.method.message_count == 0, ok
    gen = ch.queue_declare("", exclusive=True)
    assert gen.method.queue.startswith("amq.gen-"), gen.method.queue
    passive = ch.queue_declare(name, passive=True)
    assert passive.method.queue == name
    ch.queue_delete(name)
    ch.close()


@flow("publish and get with properties")
def _publish_get():
    ch = state["conn"].channel()
    q = unique("get")
    ch.queue_declare(q)
    method, _, _ = ch.basic_get(q)
    assert method is None, "get on an empty queue must be get-empty"
    props = pika.BasicProperties(
        content_type="application/json",
        headers={"x-trace": "abc", "n": 42, "nested": {"k": "v"}},
        delivery_mode=2,
        correlation_id="c-1",
        message_id="m-1",
    )
    ch.basic_publish("", q, b'{"hello": "pika"}', props)
    method, got, body = get_one(ch, q, auto_ack=False)
    assert body == b'{"hello": "pika"}', body
    assert got.content_type == "application/json"
    assert got.headers == {"x-trace": "abc", "n": 42, "nested": {"k": "v"}}, got.headers
    assert got.delivery_mode == 2 and got.correlation_id == "c-1" and got.message_id == "m-1"
    assert method.redelivered is False and method.routing_key == q
    ch.basic_ack(method.delivery_tag)
    ch.queue_delete(q)
    ch.close()


@flow("consume with manual ack, in order")
def _consume():
    conn = state["conn"]
    ch = conn.channel()
    q = unique("consume")
    ch.queue_declare(q)
    for i in range(20):
        ch.basic_publish("", q, str(i).encode())
    got = []

    def on_message(channel, method, _props, body):
        got.append(body.decode())
        channel.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(q, on_message)
    assert tag.startswith("ctag") or tag.startswith("amq.ctag-"), tag
    pump(conn, lambda: len(got) >= 20, "20 deliveries")
    assert got == [str(i) for i in range(20)], got
    ch.basic_cancel(tag)
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    ch.queue_delete(q)
    ch.close()


@flow("prefetch limits unacked deliveries")
def _prefetch():
    conn = state["conn"]
    ch = conn.channel()
    q = unique("prefetch")
    ch.queue_declare(q)
    for i in range(5):
        ch.basic_publish("", q, str(i).encode())
    ch.basic_qos(prefetch_count=2)
    held = []
    ch.basic_consume(q, lambda _c, method, _p, _b: held.append(method.delivery_tag))
    pump(conn, lambda: len(held) >= 2, "2 deliveries")
    conn.process_data_events(time_limit=QUIET)
    assert len(held) == 2, f"prefetch 2 must hold back the third message, got {len(held)}"
    ch.basic_ack(held[0])
    pump(conn, lambda: len(held) >= 3, "a third delivery after one ack")
    conn.process_data_events(time_limit=QUIET)
    assert len(held) == 3, held
    ch.basic_ack(held[-1], multiple=True)
    pump(conn, lambda: len(held) >= 5, "the remaining deliveries")
    ch.basic_ack(held[-1], multiple=True)
    ch.queue_delete(q)
    ch.close()


@flow("unacked messages are requeued when the channel closes")
def _requeue():
    conn = state["conn"]
    admin = conn.channel()
    q = unique("requeue")
    admin.queue_declare(q)
    admin.basic_publish("", q, b"first")
    admin.basic_publish("", q, b"second")
    worker = conn.channel()
    _, _, body = get_one(worker, q, auto_ack=False)
    assert body == b"first"
    worker.close()  # without acking
    method, _, body = get_one(admin, q, auto_ack=True)
    assert body == b"first" and method.redelivered is True, (body, method)
    method, _, body = get_one(admin, q, auto_ack=True)
    assert body == b"second" and method.redelivered is False, (body, method)
    admin.queue_delete(q)
    admin.close()


@flow("unacked messages are requeued when the connection closes")
def _requeue_conn():
    admin = state["conn"].channel()
    q = unique("requeue-conn")
    admin.queue_declare(q)
    admin.basic_publish("", q, b"only")
    other = connect()
    wch = other.channel()
    _, _, body = get_one(wch, q, auto_ack=False)
    assert body == b"only"
    other.close()
    method, _, body = get_one(admin, q, auto_ack=True)
    assert body == b"only" and method.redelivered is True
    admin.queue_delete(q)
    admin.close()


@flow("nack with requeue and reject")
def _nack():
    ch = state["conn"].channel()
    q = unique("nack")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"n")
    method, _, _ = get_one(ch, q, auto_ack=False)
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, _, _ = get_one(ch, q, auto_ack=False)
    assert method.redelivered is True
    ch.basic_reject(method.delivery_tag, requeue=False)
    assert ch.basic_get(q)[0] is None, "rejected without requeue: gone"
    ch.queue_delete(q)
    ch.close()


@flow("publisher confirms")
def _confirms():
    ch = state["conn"].channel()
    ch.confirm_delivery()
    q = unique("confirm")
    ch.queue_declare(q)
    for i in range(50):
        ch.basic_publish("", q, str(i).encode())  # blocks until the broker acks; raises on nack
    assert ch.queue_declare(q, passive=True).method.message_count == 50
    try:
        ch.basic_publish("", unique("nowhere"), b"x", mandatory=True)
        raise AssertionError("a mandatory publish to no queue must raise UnroutableError")
    except UnroutableError as e:
        returned = e.messages[0]
        assert returned.method.reply_code == 312 and returned.method.reply_text == "NO_ROUTE", returned.method
        assert returned.body == b"x"
    ch.queue_delete(q)
    ch.close()


@flow("channel error is reported and leaves the connection usable")
def _channel_error():
    conn = state["conn"]
    ch = conn.channel()
    q = unique("missing")
    try:
        ch.queue_declare(q, passive=True)
        raise AssertionError("passive declare of a missing queue must fail")
    except ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        assert e.reply_text == f"NOT_FOUND - no queue '{q}' in vhost '/'", e.reply_text
    other = conn.channel()
    other.queue_declare("", exclusive=True)
    other.close()


@flow("server cancels a consumer when its queue is deleted")
def _server_cancel():
    conn = state["conn"]
    ch = conn.channel()
    q = unique("srv-cancel")
    ch.queue_declare(q)
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    ch.basic_consume(q, lambda *a: None)
    admin = conn.channel()
    admin.queue_delete(q)
    pump(conn, lambda: cancelled, "basic.cancel from the server")
    admin.close()
    ch.close()


@flow("close the connection")
def _close():
    state["conn"].close()


def main():
    current = "(start)"
    try:
        for name, fn in FLOWS:
            current = name
            fn()
            print(f"ok - {name}", flush=True)
    except Exception as e:  # noqa: BLE001 - report any failure
        print(f"FAIL: {current}: {e!r}", file=sys.stderr)
        traceback.print_exc()
        return 1
    print(f"pika: {len(FLOWS)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
