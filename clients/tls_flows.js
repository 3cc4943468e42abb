#!/usr/bin/env node
// amqplib over TLS (amqps://): a PLAIN login trusting the test CA (the `ca` socket option), then an
// EXTERNAL login with a client certificate (amqplib's credentials.external()), each publishing and
// getting one message. Usage: node tls_flows.js PORT CA.pem CLIENT.pem CLIENT.key
// Prints one "<flow>: ok" line per flow; exits non-zero on the first failure.
'use strict';

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const amqp = require('amqplib');

const [port, caFile, certFile, keyFile] = process.argv.slice(2);
const ca = [fs.readFileSync(caFile)];
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function roundTrip(url, options, flow) {
  const conn = await amqp.connect(url, options);
  const ch = await conn.createChannel();
  const q = `tls-js-${crypto.randomBytes(6).toString('hex')}`;
  await ch.assertQueue(q);
  ch.sendToQueue(q, Buffer.from('over tls'));
  let msg = false;
  for (let i = 0; i < 100 && !msg; i++) {
    msg = await ch.get(q, { noAck: true });
    if (!msg) await sleep(20);
  }
  assert.ok(msg, 'message never arrived');
  assert.equal(msg.content.toString(), 'over tls');
  await conn.close();
  console.log(`${flow}: ok`);
}

(async () => {
  await roundTrip(`amqps://guest:guest@127.0.0.1:${port}/%2f`, { ca, servername: 'localhost' }, 'amqps with the CA');
  await roundTrip(
    `amqps://127.0.0.1:${port}/%2f`,
    {
      ca,
      servername: 'localhost',
      cert: fs.readFileSync(certFile),
      key: fs.readFileSync(keyFile),
      credentials: amqp.credentials.external(),
    },
    'EXTERNAL login',
  );
})().catch((e) => {
  console.error(`FAIL: ${e && e.stack ? e.stack : e}`);
  process.exit(1);
});
