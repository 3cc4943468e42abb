#!/usr/bin/env python3
"""pika over TLS (amqps): a PLAIN login with the test CA as trust root, then an EXTERNAL login with
a client certificate (pika's ExternalCredentials), each publishing and getting one message.
Usage: python3 tls_flows.py PORT CA.pem CLIENT.pem CLIENT.key

Prints one "<flow>: ok" line per flow; exits non-zero on the first failure.
"""

import ssl
import sys
import uuid

try:
    import pika
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import pika: {e} (scripts/test installs it into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

PORT, CA, CERT, KEY = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]


def round_trip(params, flow):
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    q = f"tls-py-{uuid.uuid4().hex[:12]}"
    ch.queue_declare(q)
    ch.basic_publish("", q, b"over tls")
    for _ in range(100):
        method, _, body = ch.basic_get(q, auto_ack=True)
        if method:
            assert body == b"over tls", body
            break
        conn.sleep(0.02)
    else:
        raise AssertionError("message never arrived")
    conn.close()
    print(f"{flow}: ok", flush=True)


context = ssl.create_default_context(cafile=CA)
round_trip(
    pika.ConnectionParameters(
        host="127.0.0.1",
        port=PORT,
        credentials=pika.PlainCredentials("guest", "guest"),
        ssl_options=pika.SSLOptions(context, "127.0.0.1"),
    ),
    "plain login over TLS",
)

context = ssl.create_default_context(cafile=CA)
context.load_cert_chain(CERT, KEY)
round_trip(
    pika.ConnectionParameters(
        host="127.0.0.1",
        port=PORT,
        credentials=pika.credentials.ExternalCredentials(),
        ssl_options=pika.SSLOptions(context, "127.0.0.1"),
    ),
    "EXTERNAL login",
)
