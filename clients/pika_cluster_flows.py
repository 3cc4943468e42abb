"""pika on a replicated (quorum) queue of a Warren cluster, connected to a node that does not
lead it: declare, publish with confirms, basic.get with and without ack, a get taken and given
back by a closed channel, a consumer, all as an application connected to any node sees them.

Usage: pika_cluster_flows.py FOLLOWER_URL LEADER_URL QUEUE
The queue is declared by the test (as x-queue-type quorum) and is led by LEADER_URL's node.
"""

import sys
import time
import traceback

import pika

WAIT = 10.0


def connect(url):
    params = pika.URLParameters(url)
    params.socket_timeout = WAIT
    params.blocked_connection_timeout = WAIT
    return pika.BlockingConnection(params)


def get_one(ch, queue, auto_ack):
    """basic.get until a message arrives (a publish reaches a follower once it is committed)."""
    deadline = time.monotonic() + WAIT
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        if time.monotonic() > deadline:
            raise AssertionError(f"no message in {queue}")
        time.sleep(0.01)


def main():
    follower_url, leader_url, q = sys.argv[1], sys.argv[2], sys.argv[3]
    step = "(start)"
    try:
        step = "passive declare on the follower"
        follower = connect(follower_url)
        ch = follower.channel()
        ok = ch.queue_declare(q, durable=True, passive=True)
        assert ok.method.message_count == 0, ok

        step = "publish with confirms on the follower and on the leader"
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2, headers={"n": 1}, correlation_id="c-1")
        for i in range(3):
            ch.basic_publish("", q, f"f{i}".encode(), props, mandatory=True)
        leader = connect(leader_url)
        lch = leader.channel()
        lch.confirm_delivery()
        for i in range(3):
            lch.basic_publish("", q, f"l{i}".encode(), props, mandatory=True)

        step = "basic.get with manual ack on the follower"
        method, got, body = get_one(ch, q, auto_ack=False)
        assert body == b"f0", body
        # As RabbitMQ 3.10's quorum queues: every get carries x-delivery-count.
        assert got.headers == {"n": 1, "x-delivery-count": 0}, got.headers
        assert got.correlation_id == "c-1", got
        assert method.redelivered is False and method.message_count == 5, method
        ch.basic_ack(method.delivery_tag)

        step = "basic.get with auto-ack on the follower"
        _, _, body = get_one(ch, q, auto_ack=True)
        assert body == b"f1", body

        step = "a get given back by its closed channel comes again, redelivered"
        other = follower.channel()
        method, _, body = get_one(other, q, auto_ack=False)
        assert body == b"f2" and not method.redelivered, (body, method)
        other.close()
        method, got, body = get_one(ch, q, auto_ack=False)
        assert body == b"f2" and method.redelivered, (body, method)
        assert got.headers["x-delivery-count"] == 1, got.headers
        ch.basic_ack(method.delivery_tag)

        step = "a consumer on the follower takes the rest, in order"
        seen = []

        def on_message(c, m, _p, b):
            seen.append(b)
            c.basic_ack(m.delivery_tag)

        ch.basic_qos(prefetch_count=2)
        tag = ch.basic_consume(q, on_message)
        deadline = time.monotonic() + WAIT
        while len(seen) < 3:
            if time.monotonic() > deadline:
                raise AssertionError(f"consumed only {seen}")
            follower.process_data_events(time_limit=0.05)
        assert seen == [b"l0", b"l1", b"l2"], seen
        ch.basic_cancel(tag)

        step = "the queue is empty on the leader"
        deadline = time.monotonic() + WAIT
        while lch.queue_declare(q, durable=True, passive=True).method.message_count != 0:
            if time.monotonic() > deadline:
                raise AssertionError("messages left on the leader")
            time.sleep(0.02)
        method, _, _ = ch.basic_get(q)
        assert method is None, "an empty queue gives get-empty"
        follower.close()
        leader.close()
    except Exception as e:  # noqa: BLE001 - report any failure
        print(f"FAIL: {step}: {e!r}", file=sys.stderr)
        traceback.print_exc()
        return 1
    print("pika on a cluster: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
