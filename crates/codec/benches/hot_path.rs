//! Hot-path micro-benchmarks: decoding a batch of publishes (method + header + body
//! frames) and encoding deliveries.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use warren_codec::{
    encode_ack, encode_content, encode_deliver, encode_method, BasicProperties, BasicPublish,
    FieldTable, FieldValue, Frame, FrameDecoder, Method,
};

const BATCH: usize = 100;
const FRAME_MAX: u32 = 131072;

fn props() -> Bytes {
    let mut h = FieldTable::new();
    h.insert(
        "x-trace-id",
        FieldValue::long_str("0af7651916cd43dd8448eb211c80319c"),
    );
    BasicProperties {
        content_type: Some("application/json".into()),
        delivery_mode: Some(2),
        headers: Some(h),
        message_id: Some("m-123456".into()),
        ..Default::default()
    }
    .encode()
}

fn publish_batch(body_len: usize) -> BytesMut {
    let props = props();
    let body = vec![7u8; body_len];
    let mut out = BytesMut::new();
    for _ in 0..BATCH {
        encode_method(
            &mut out,
            1,
            &Method::from(BasicPublish {
                exchange: "amq.topic".into(),
                routing_key: "orders.eu.created".into(),
                ..Default::default()
            }),
        );
        encode_content(&mut out, 1, 60, &props, &body, FRAME_MAX);
    }
    out
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_publish_batch");
    for body_len in [256usize, 4096] {
        let input = publish_batch(body_len);
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(format!("body_{body_len}"), |b| {
            b.iter_batched_ref(
                || input.clone(),
                |buf| {
                    let mut dec = FrameDecoder::new(FRAME_MAX);
                    let mut n = 0usize;
                    while let Ok(Some(f)) = dec.decode(buf) {
                        if let Frame::Body { payload, .. } = &f {
                            n += payload.len();
                        }
                        black_box(&f);
                    }
                    n
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn encode(c: &mut Criterion) {
    let props = props();
    let mut g = c.benchmark_group("encode");
    for body_len in [256usize, 65536] {
        let body = vec![7u8; body_len];
        let mut out = BytesMut::with_capacity(1 << 20);
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("deliver_body_{body_len}"), |b| {
            b.iter(|| {
                out.clear();
                encode_deliver(
                    &mut out,
                    1,
                    "amq.ctag-abcdefgh",
                    black_box(123_456),
                    false,
                    "amq.topic",
                    "orders.eu.created",
                    &props,
                    &body,
                    FRAME_MAX,
                );
                out.len()
            })
        });
    }
    let mut out = BytesMut::with_capacity(1 << 16);
    g.bench_function("ack", |b| {
        b.iter(|| {
            out.clear();
            encode_ack(&mut out, 1, black_box(99), false);
            out.len()
        })
    });
    g.finish();
}

criterion_group!(benches, decode, encode);
criterion_main!(benches);
