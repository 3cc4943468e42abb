#!/usr/bin/env python3
"""asyncio flows driven by aio-pika (on aiormq), used as an asyncio application written for RabbitMQ uses it.

Usage:
  python3 aiopika_flows.py amqp://guest:guest@127.0.0.1:5672/%2f          # confirms, direct reply-to RPC
  python3 aiopika_flows.py amqp://guest:guest@127.0.0.1:5672/%2f robust   # reconnection across broker restarts

The robust flow needs whoever runs it to restart the broker (same port, same data directory) on request: it
prints a line "RESTART-BROKER <how>" (how = "term": SIGTERM and start again; "kill": SIGKILL and start again)
and waits for one line on its standard input, sent once the broker listens again. The conformance test
(conformance/tests/cross_client.rs) does this with TestBroker::restart.

Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" on the first failure.
"""

import asyncio
import os
import sys
import time
import traceback
import uuid

try:
    import aio_pika
    import aiormq
    from aio_pika.exceptions import ChannelPreconditionFailed, PublishError
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import aio_pika: {e} (scripts/test installs it into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WARREN_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
MODE = sys.argv[2] if len(sys.argv) > 2 else "core"
WAIT = 10.0
QUIET = 0.3


def unique(prefix):
    return f"{prefix}-aiopika-{uuid.uuid4().hex[:12]}"


async def within(what, aw, timeout=WAIT):
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


FLOWS = {"core": [], "robust": []}


def flow(mode, name):
    def register(fn):
        FLOWS[mode].append((name, fn))
        return fn

    return register


state = {}


# ------------------------------------------------------------------------------------------------ core flows


@flow("core", "connect")
async def _connect():
    conn = await within("connect", aio_pika.connect(URL))
    state["conn"] = conn
    caps = conn.transport.connection.server_capabilities
    for cap in ("publisher_confirms", "basic.nack", "consumer_cancel_notify", "direct_reply_to"):
        assert caps.get(cap) is True, f"capability {cap}: {caps}"


@flow("core", "confirms: 100 concurrent confirmed publishes, consumed in order with manual ack")
async def _confirms():
    ch = await state["conn"].channel(publisher_confirms=True)
    q = await ch.declare_queue(unique("confirms"), auto_delete=False)
    sent = [
        aio_pika.Message(
            f"m{i}".encode(),
            content_type="text/plain",
            headers={"i": i, "trace": "aiopika"},
            message_id=f"id-{i}",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT if i % 2 else aio_pika.DeliveryMode.NOT_PERSISTENT,
        )
        for i in range(100)
    ]
    confirms = await within(
        "100 confirms", asyncio.gather(*(ch.default_exchange.publish(m, routing_key=q.name) for m in sent))
    )
    assert all(isinstance(c, aiormq.spec.Basic.Ack) for c in confirms), {type(c).__name__ for c in confirms}
    declared = await ch.declare_queue(q.name, passive=True)
    assert declared.declaration_result.message_count == 100, declared.declaration_result

    got = []
    async with q.iterator() as it:
        async for message in it:
            got.append(message)
            await message.ack()
            if len(got) == 100:
                break
    bodies = [m.body.decode() for m in got]
    assert bodies == [f"m{i}" for i in range(100)], bodies[:10]
    for i, m in enumerate(got):
        assert m.headers == {"i": i, "trace": "aiopika"}, m.headers
        assert m.message_id == f"id-{i}" and m.content_type == "text/plain", (m.message_id, m.content_type)
        assert m.delivery_mode == (aio_pika.DeliveryMode.PERSISTENT if i % 2 else aio_pika.DeliveryMode.NOT_PERSISTENT)
        assert m.redelivered is False
    left = await ch.declare_queue(q.name, passive=True)
    assert left.declaration_result.message_count == 0, left.declaration_result
    await q.delete()
    await ch.close()


@flow("core", "confirms: an unroutable mandatory publish is returned (312 NO_ROUTE), then acked")
async def _returned():
    ch = await state["conn"].channel(publisher_confirms=True, on_return_raises=True)
    try:
        await within(
            "confirm of an unroutable message",
            ch.default_exchange.publish(aio_pika.Message(b"lost"), routing_key=unique("nowhere"), mandatory=True),
        )
        raise AssertionError("a mandatory publish to no queue must raise PublishError")
    except PublishError as e:
        frame = e.frame
        assert frame.reply_code == 312 and frame.reply_text == "NO_ROUTE", frame
    # The channel stays usable.
    q = await ch.declare_queue(exclusive=True)
    confirm = await ch.default_exchange.publish(aio_pika.Message(b"ok"), routing_key=q.name, mandatory=True)
    assert isinstance(confirm, aiormq.spec.Basic.Ack), confirm
    await ch.close()


@flow("core", "rpc: 20 concurrent calls over direct reply-to (amq.rabbitmq.reply-to)")
async def _rpc():
    # The server: its own connection, a request queue, replies to whatever reply_to says.
    server_conn = await aio_pika.connect(URL)
    server_ch = await server_conn.channel()
    requests = await server_ch.declare_queue(unique("rpc-requests"), exclusive=True)
    seen_reply_to = []

    async def serve(message: aio_pika.abc.AbstractIncomingMessage):
        async with message.process():
            seen_reply_to.append(message.reply_to)
            n = int(message.body)
            await server_ch.default_exchange.publish(
                aio_pika.Message(str(n * n).encode(), correlation_id=message.correlation_id),
                routing_key=message.reply_to,
            )

    await requests.consume(serve)

    # The client: consume from the pseudo-queue with no-ack, then publish requests naming it.
    ch = await state["conn"].channel()
    reply_queue = await ch.get_queue("amq.rabbitmq.reply-to", ensure=False)
    pending = {}

    async def on_reply(message: aio_pika.abc.AbstractIncomingMessage):
        fut = pending.pop(message.correlation_id, None)
        if fut is not None:
            fut.set_result((message.body, message.routing_key))

    await reply_queue.consume(on_reply, no_ack=True)
    loop = asyncio.get_running_loop()
    calls = []
    for n in range(20):
        cid = str(uuid.uuid4())
        pending[cid] = loop.create_future()
        calls.append((n, pending[cid]))
        await ch.default_exchange.publish(
            aio_pika.Message(str(n).encode(), correlation_id=cid, reply_to="amq.rabbitmq.reply-to"),
            routing_key=requests.name,
        )
    replies = await within("20 replies over direct reply-to", asyncio.gather(*(f for _, f in calls)))
    for (n, _), (body, routing_key) in zip(calls, replies):
        assert body == str(n * n).encode(), (n, body)
        assert routing_key.startswith("amq.rabbitmq.reply-to."), routing_key
    assert len(seen_reply_to) == 20, seen_reply_to
    for r in seen_reply_to:
        assert r.startswith("amq.rabbitmq.reply-to.") and len(r) > len("amq.rabbitmq.reply-to."), (
            f"reply_to must be rewritten to the channel's own address, got {r!r}"
        )
    assert len(set(seen_reply_to)) == 1, f"one channel, one address: {set(seen_reply_to)}"
    await ch.close()
    await server_conn.close()


@flow("core", "rpc: asking for direct replies without consuming them is refused (406)")
async def _rpc_no_consumer():
    ch = await state["conn"].channel(publisher_confirms=False)
    q = await ch.declare_queue(exclusive=True)
    try:
        await ch.default_exchange.publish(
            aio_pika.Message(b"x", reply_to="amq.rabbitmq.reply-to"), routing_key=q.name
        )
        # The refusal arrives as channel.close; the next synchronous call sees it.
        await within("the channel to be closed", ch.declare_queue(q.name, passive=True))
        raise AssertionError("a publish with reply_to=amq.rabbitmq.reply-to and no reply consumer must fail")
    except ChannelPreconditionFailed as e:  # reply code 406
        assert e.args == ("PRECONDITION_FAILED - fast reply consumer does not exist",), e.args
    other = await state["conn"].channel()
    await other.declare_queue(exclusive=True)
    await other.close()


@flow("core", "close")
async def _close():
    await within("connection close", state["conn"].close())


# ---------------------------------------------------------------------------------------------- robust flow


async def read_line():
    """One line of standard input, without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


class Inbox:
    """Deliveries of one consumer, in arrival order."""

    def __init__(self):
        self.items = asyncio.Queue()

    async def on_message(self, message):
        await self.items.put(message)

    async def next(self, what):
        return await within(what, self.items.get())

    async def nothing(self, what):
        try:
            m = await asyncio.wait_for(self.items.get(), QUIET)
        except asyncio.TimeoutError:
            return
        raise AssertionError(f"{what}: unexpected delivery {m.body!r}")


@flow("robust", "robust: connect_robust, durable queue, consumer with prefetch 1")
async def _robust_setup():
    conn = await within("connect_robust", aio_pika.connect_robust(URL, reconnect_interval=0.2))
    reconnects = asyncio.Queue()
    conn.reconnect_callbacks.add(lambda *_: reconnects.put_nowait(time.monotonic()))
    ch = await conn.channel(publisher_confirms=True)
    await ch.set_qos(prefetch_count=1)
    q = await ch.declare_queue(unique("robust"), durable=True)
    inbox = Inbox()
    await q.consume(inbox.on_message)
    state.update(conn=conn, ch=ch, q=q, inbox=inbox, reconnects=reconnects)
    for i in range(3):
        await ch.default_exchange.publish(
            aio_pika.Message(f"before-{i}".encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=q.name,
        )
    for i in range(3):
        m = await inbox.next(f"before-{i}")
        assert m.body == f"before-{i}".encode(), m.body
        await m.ack()


async def restart_round(how, round_no):
    ch, q, inbox = state["ch"], state["q"], state["inbox"]
    # One message held unacked by the consumer, three more queued behind it (prefetch 1), all persistent and
    # confirmed: the broker has them on disk when the restart comes.
    names = [f"r{round_no}-held"] + [f"r{round_no}-queued-{i}" for i in range(3)]
    for name in names:
        confirm = await ch.default_exchange.publish(
            aio_pika.Message(name.encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=q.name
        )
        assert isinstance(confirm, aiormq.spec.Basic.Ack), confirm
    held = await inbox.next("the first message of the round")
    assert held.body == names[0].encode() and held.redelivered is False, (held.body, held.redelivered)
    await inbox.nothing("prefetch 1 with one unacked")

    print(f"RESTART-BROKER {how}", flush=True)
    line = await within("the harness to restart the broker (a line on stdin)", read_line(), timeout=60)
    assert line.strip() == "restarted", f"expected 'restarted' on stdin, got {line!r}"
    t = time.monotonic()
    await within("connect_robust to reconnect", state["reconnects"].get(), timeout=15)
    print(f"   reconnected {time.monotonic() - t:.2f} s after the broker was back", flush=True)

    # The restored consumer gets the held message again (redelivered), then the queued ones, in order.
    got = []
    for name in names:
        m = await inbox.next(f"{name} after the restart")
        got.append((m.body.decode(), m.redelivered))
        await m.ack()
    assert [b for b, _ in got] == names, f"after the restart: {got}"
    assert got[0][1] is True, f"the message held unacked across the restart must come back redelivered: {got}"
    await inbox.nothing("after the restored messages")

    # The same channel object publishes again, and the same consumer keeps consuming.
    for i in range(3):
        confirm = await within(
            "a confirm after the reconnection",
            ch.default_exchange.publish(
                aio_pika.Message(f"r{round_no}-after-{i}".encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=q.name,
            ),
        )
        assert isinstance(confirm, aiormq.spec.Basic.Ack), confirm
    for i in range(3):
        m = await inbox.next(f"r{round_no}-after-{i}")
        assert m.body == f"r{round_no}-after-{i}".encode() and m.redelivered is False, (m.body, m.redelivered)
        await m.ack()
    flags = ", ".join(f"{b}{' (redelivered)' if r else ''}" for b, r in got)
    print(f"   restored: {flags}", flush=True)


@flow("robust", "robust: the broker stops (SIGTERM) and starts again; the consumer keeps consuming")
async def _robust_term():
    await restart_round("term", 1)


@flow("robust", "robust: the broker is killed (SIGKILL) and starts again; the consumer keeps consuming")
async def _robust_kill():
    await restart_round("kill", 2)


@flow("robust", "robust: tidy up")
async def _robust_close():
    await state["q"].delete(if_unused=False, if_empty=False)
    await within("connection close", state["conn"].close())


async def main():
    if MODE not in FLOWS:
        print(f"FAIL: unknown mode {MODE!r} (core or robust)", file=sys.stderr)
        return 2
    flows = FLOWS[MODE]
    current = "(start)"
    t_start = time.monotonic()
    try:
        for name, fn in flows:
            current = name
            t = time.monotonic()
            await fn()
            print(f"ok - {name} ({time.monotonic() - t:.2f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - report any failure
        print(f"FAIL: {current}: {e!r}", file=sys.stderr)
        traceback.print_exc()
        return 1
    print(f"aio-pika {MODE}: {time.monotonic() - t_start:.1f} s")
    print(f"aio-pika: {len(flows)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
