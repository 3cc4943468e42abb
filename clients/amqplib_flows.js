#!/usr/bin/env node
// Core AMQP flows driven by amqplib (the Node.js client), unchanged from how an application written for
// RabbitMQ uses it. Usage: node amqplib_flows.js amqp://guest:guest@127.0.0.1:5672/%2f
// Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" on the first failure.
'use strict';

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const amqp = require('amqplib');

const url = process.argv[2] || process.env.WARREN_TEST_URL || 'amqp://guest:guest@127.0.0.1:5672/%2f';
const QUIET_MS = 300;
const WAIT_MS = 10000;

const unique = (prefix) => `${prefix}-js-${crypto.randomBytes(6).toString('hex')}`;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function withTimeout(promise, what, ms = WAIT_MS) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// Collects deliveries of a consumer into an array, with a way to wait for the next ones.
function collector() {
  const items = [];
  const waiters = [];
  return {
    items,
    push(msg) {
      items.push(msg);
      while (waiters.length && waiters[0].n <= items.length) waiters.shift().resolve();
    },
    waitFor(n, what) {
      if (items.length >= n) return Promise.resolve();
      return withTimeout(new Promise((resolve) => waiters.push({ n, resolve })), what);
    },
  };
}

// basic.get until a message arrives (publishes are asynchronous).
async function getOne(ch, queue, options) {
  const deadline = Date.now() + WAIT_MS;
  for (;;) {
    const msg = await ch.get(queue, options);
    if (msg) return msg;
    if (Date.now() > deadline) throw new Error(`no message in ${queue}`);
    await sleep(5);
  }
}

const flows = [];
const flow = (name, fn) => flows.push({ name, fn });

let conn;

flow('connect and read server capabilities', async () => {
  conn = await withTimeout(amqp.connect(url), 'connect');
  conn.on('error', () => {});
  const props = conn.connection.serverProperties;
  assert.ok(props, 'no server properties');
  for (const cap of ['publisher_confirms', 'basic.nack', 'consumer_cancel_notify', 'per_consumer_qos']) {
    assert.equal(props.capabilities[cap], true, `capability ${cap}`);
  }
});

flow('declare queues (named and server-named)', async () => {
  const ch = await conn.createChannel();
  const name = unique('decl');
  const ok = await ch.assertQueue(name, { durable: false });
  assert.equal(ok.queue, name);
  assert.equal(ok.messageCount, 0);
  const gen = await ch.assertQueue('', { exclusive: true });
  assert.ok(gen.queue.startsWith('amq.gen-'), `server-named queue ${gen.queue}`);
  await ch.deleteQueue(name);
  await ch.close();
});

flow('publish and get with properties', async () => {
  const ch = await conn.createChannel();
  const q = unique('get');
  await ch.assertQueue(q);
  assert.equal(await ch.get(q), false, 'get on an empty queue returns false (get-empty)');
  ch.sendToQueue(q, Buffer.from('hello amqplib'), {
    contentType: 'text/plain',
    headers: { 'x-trace': 'abc', n: 42 },
    messageId: 'm-1',
    persistent: true,
  });
  const msg = await getOne(ch, q, { noAck: false });
  assert.equal(msg.content.toString(), 'hello amqplib');
  assert.equal(msg.properties.contentType, 'text/plain');
  assert.equal(msg.properties.messageId, 'm-1');
  assert.equal(msg.properties.deliveryMode, 2);
  assert.deepEqual(msg.properties.headers, { 'x-trace': 'abc', n: 42 });
  assert.equal(msg.fields.redelivered, false);
  assert.equal(msg.fields.routingKey, q);
  ch.ack(msg);
  await ch.deleteQueue(q);
  await ch.close();
});

flow('consume with manual ack, in order', async () => {
  const ch = await conn.createChannel();
  const q = unique('consume');
  await ch.assertQueue(q);
  for (let i = 0; i < 20; i++) ch.sendToQueue(q, Buffer.from(String(i)));
  const got = collector();
  const { consumerTag } = await ch.consume(q, (msg) => {
    got.push(msg);
    ch.ack(msg);
  });
  assert.ok(consumerTag.startsWith('amq.ctag-'), `consumer tag ${consumerTag}`);
  await got.waitFor(20, '20 deliveries');
  assert.deepEqual(got.items.map((m) => m.content.toString()), [...Array(20).keys()].map(String));
  await ch.cancel(consumerTag);
  const check = await ch.checkQueue(q);
  assert.equal(check.messageCount, 0, 'all messages acked');
  await ch.deleteQueue(q);
  await ch.close();
});

flow('prefetch limits unacked deliveries', async () => {
  const ch = await conn.createChannel();
  const q = unique('prefetch');
  await ch.assertQueue(q);
  for (let i = 0; i < 5; i++) ch.sendToQueue(q, Buffer.from(String(i)));
  await ch.prefetch(2);
  const got = collector();
  await ch.consume(q, (msg) => got.push(msg));
  await got.waitFor(2, '2 deliveries');
  await sleep(QUIET_MS);
  assert.equal(got.items.length, 2, 'prefetch 2 must hold back the third message');
  ch.ack(got.items[0]);
  await got.waitFor(3, 'a third delivery after one ack');
  await sleep(QUIET_MS);
  assert.equal(got.items.length, 3);
  ch.ackAll();
  await got.waitFor(5, 'the remaining deliveries');
  ch.ackAll();
  await ch.deleteQueue(q);
  await ch.close();
});

flow('unacked messages are requeued when the channel closes', async () => {
  const admin = await conn.createChannel();
  const q = unique('requeue');
  await admin.assertQueue(q);
  admin.sendToQueue(q, Buffer.from('first'));
  admin.sendToQueue(q, Buffer.from('second'));
  const worker = await conn.createChannel();
  const a = await getOne(worker, q, { noAck: false });
  assert.equal(a.content.toString(), 'first');
  await worker.close(); // without acking
  const again = await getOne(admin, q, { noAck: true });
  assert.equal(again.content.toString(), 'first', 'requeued at its original position');
  assert.equal(again.fields.redelivered, true);
  const next = await getOne(admin, q, { noAck: true });
  assert.equal(next.content.toString(), 'second');
  assert.equal(next.fields.redelivered, false);
  await admin.deleteQueue(q);
  await admin.close();
});

flow('nack with requeue and reject', async () => {
  const ch = await conn.createChannel();
  const q = unique('nack');
  await ch.assertQueue(q);
  ch.sendToQueue(q, Buffer.from('n'));
  const m1 = await getOne(ch, q, { noAck: false });
  ch.nack(m1, false, true);
  const m2 = await getOne(ch, q, { noAck: false });
  assert.equal(m2.fields.redelivered, true);
  ch.reject(m2, false);
  assert.equal(await ch.get(q), false, 'rejected without requeue: gone');
  await ch.deleteQueue(q);
  await ch.close();
});

flow('publisher confirms', async () => {
  const ch = await conn.createConfirmChannel();
  const q = unique('confirm');
  await ch.assertQueue(q);
  const acks = [];
  for (let i = 0; i < 50; i++) {
    acks.push(
      new Promise((resolve, reject) => {
        ch.sendToQueue(q, Buffer.from(String(i)), {}, (err) => (err ? reject(err) : resolve()));
      }),
    );
  }
  await withTimeout(Promise.all(acks), '50 publisher confirms');
  await withTimeout(ch.waitForConfirms(), 'waitForConfirms');
  const check = await ch.checkQueue(q);
  assert.equal(check.messageCount, 50);
  await ch.deleteQueue(q);
  await ch.close();
});

flow('mandatory publish to no queue is returned', async () => {
  const ch = await conn.createConfirmChannel();
  const returned = new Promise((resolve) => ch.once('return', resolve));
  const rk = unique('nowhere');
  ch.publish('', rk, Buffer.from('back'), { mandatory: true });
  const msg = await withTimeout(returned, 'basic.return');
  assert.equal(msg.fields.replyCode, 312);
  assert.equal(msg.fields.replyText, 'NO_ROUTE');
  assert.equal(msg.fields.routingKey, rk);
  assert.equal(msg.content.toString(), 'back');
  await withTimeout(ch.waitForConfirms(), 'the confirm of the returned message');
  await ch.close();
});

flow('channel error is reported and leaves the connection usable', async () => {
  const ch = await conn.createChannel();
  ch.on('error', () => {});
  const q = unique('missing');
  await assert.rejects(ch.checkQueue(q), (err) => {
    assert.equal(err.code, 404);
    assert.match(err.message, new RegExp(`NOT_FOUND - no queue '${q}' in vhost '/'`));
    return true;
  });
  const other = await conn.createChannel();
  await other.assertQueue('', { exclusive: true });
  await other.close();
});

flow('server cancels a consumer when its queue is deleted', async () => {
  const ch = await conn.createChannel();
  const q = unique('srv-cancel');
  await ch.assertQueue(q);
  const cancelled = new Promise((resolve) => {
    ch.consume(q, (msg) => {
      if (msg === null) resolve();
    });
  });
  const admin = await conn.createChannel();
  await admin.deleteQueue(q);
  await withTimeout(cancelled, 'the consumer callback with null (basic.cancel from the server)');
  await admin.close();
  await ch.close();
});

flow('closing with publishes still buffered completes the close handshake', async () => {
  // A new user's first try: publish until the client's buffer is full, then close at once. amqplib
  // sends connection.close ahead of the publishes still in its buffer; the broker must read past
  // its close-ok until the client closes, or the client sees a reset (EPIPE) instead of a close.
  const other = await amqp.connect(url);
  const errors = [];
  other.on('error', (err) => errors.push(err));
  const ch = await other.createChannel();
  ch.on('error', (err) => errors.push(err));
  const q = unique('flood');
  await ch.assertQueue(q, { autoDelete: false });
  const body = Buffer.alloc(1024, 7);
  let sent = 0;
  while (ch.sendToQueue(q, body) && sent < 200000) sent += 1;
  await withTimeout(other.close(), 'connection.close with publishes still buffered');
  assert.deepEqual(errors.map(String), []);
  const admin = await conn.createChannel();
  await admin.deleteQueue(q);
  await admin.close();
});

flow('close the connection', async () => {
  await conn.close();
});

(async () => {
  let current = '(start)';
  try {
    for (const { name, fn } of flows) {
      current = name;
      await withTimeout(fn(), name, 20000);
      console.log(`ok - ${name}`);
    }
    console.log(`amqplib: ${flows.length} passed, 0 failed`);
    process.exit(0);
  } catch (err) {
    console.error(`FAIL: ${current}: ${err && err.stack ? err.stack : err}`);
    process.exit(1);
  }
})();
