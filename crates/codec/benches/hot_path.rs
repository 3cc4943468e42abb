//! Hot-path micro-benchmarks, Warren's hand-written codec against amq-protocol 10.6
//! (nom parser, cookie-factory generator) doing the same work:
//!
//! - `decode publish x100/<size>/...`: decode a batch of 100 publishes (basic.publish
//!   method + content header + body frames, 300 frames) from one buffer. Warren uses
//!   `FrameDecoder` (frame_max enforced, body and properties kept as `Bytes` views);
//!   amq-protocol uses `parse_frame` on the same bytes, after the 7-byte frame header
//!   check a server needs because `parse_frame` does not enforce frame_max.
//! - `encode deliver/<size>/...`: encode one delivery (basic.deliver + header + body)
//!   into a buffer with room. Warren uses `encode_deliver` from the stored raw property
//!   bytes and body. `amq-protocol` builds the three `AMQPFrame`s a server built on it
//!   would build per delivery (it owns its strings, properties and body, so the stored
//!   message's properties and body are cloned) and runs `gen_frame` on each;
//!   `amq-protocol gen-only` runs `gen_frame` on three prebuilt frames (only the
//!   delivery tag changes), the generator's own cost and a lower bound.
//!
//! Before the timed runs, `main` prints allocations (count and bytes) per operation
//! for every arm, measured with a counting global allocator that only counts while
//! the measurement is switched on (outside it, one relaxed load per allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::basic::{self as ab, parse_properties, AMQPProperties};
use amq_protocol::protocol::AMQPClass;
use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use warren_codec::{
    encode_ack, encode_content, encode_deliver, encode_method, BasicProperties, BasicPublish,
    FieldTable, FieldValue, Frame, FrameDecoder, Method,
};

// ---- allocation counting -------------------------------------------------------------

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static ALLOC_BYTES: AtomicUsize = AtomicUsize::new(0);

fn note(bytes: usize) {
    if COUNTING.load(Relaxed) {
        ALLOCS.fetch_add(1, Relaxed);
        ALLOC_BYTES.fetch_add(bytes, Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations and allocated bytes per operation of `f`, which performs `ops` operations.
fn allocs_per_op(ops: usize, f: impl FnOnce()) -> (f64, f64) {
    ALLOCS.store(0, Relaxed);
    ALLOC_BYTES.store(0, Relaxed);
    COUNTING.store(true, Relaxed);
    f();
    COUNTING.store(false, Relaxed);
    let n = ALLOCS.load(Relaxed) as f64 / ops as f64;
    let b = ALLOC_BYTES.load(Relaxed) as f64 / ops as f64;
    (n, b)
}

// ---- shared inputs -------------------------------------------------------------------

const BATCH: usize = 100;
const FRAME_MAX: u32 = 131072;
const DECODE_SIZES: [usize; 2] = [256, 4096];
const ENCODE_SIZES: [usize; 2] = [256, 65536];
const CTAG: &str = "amq.ctag-abcdefgh";
const EXCHANGE: &str = "amq.topic";
const ROUTING_KEY: &str = "orders.eu.created";

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

/// The same properties as amq-protocol holds them (parsed from Warren's bytes).
fn amq_props(raw: &[u8]) -> AMQPProperties {
    let (rest, p) = parse_properties(raw).expect("amq-protocol parse_properties");
    assert!(rest.is_empty());
    p
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
                exchange: EXCHANGE.into(),
                routing_key: ROUTING_KEY.into(),
                ..Default::default()
            }),
        );
        encode_content(&mut out, 1, 60, &props, &body, FRAME_MAX);
    }
    out
}

// ---- the operations ------------------------------------------------------------------

/// Decodes every frame in `buf` with Warren; returns (frames, body bytes).
fn warren_decode(buf: &mut BytesMut) -> (usize, usize) {
    let mut dec = FrameDecoder::new(FRAME_MAX);
    let (mut frames, mut n) = (0usize, 0usize);
    while let Ok(Some(f)) = dec.decode(buf) {
        if let Frame::Body { payload, .. } = &f {
            n += payload.len();
        }
        frames += 1;
        black_box(&f);
    }
    (frames, n)
}

/// Decodes every frame in `input` with amq-protocol; returns (frames, body bytes).
fn amq_decode(mut input: &[u8]) -> (usize, usize) {
    let (mut frames, mut n) = (0usize, 0usize);
    while input.len() >= 7 {
        // parse_frame does not enforce frame_max: check the size field first
        let size = u32::from_be_bytes([input[3], input[4], input[5], input[6]]);
        if size > FRAME_MAX {
            break;
        }
        let Ok((rest, f)) = parse_frame(input) else {
            break;
        };
        if let AMQPFrame::Body(_, payload) = &f {
            n += payload.len();
        }
        frames += 1;
        black_box(&f);
        input = rest;
    }
    (frames, n)
}

fn warren_deliver(out: &mut BytesMut, tag: u64, props: &[u8], body: &[u8]) -> usize {
    encode_deliver(
        out,
        1,
        CTAG,
        tag,
        false,
        EXCHANGE,
        ROUTING_KEY,
        props,
        body,
        FRAME_MAX,
    );
    out.len()
}

fn amq_deliver_method(tag: u64) -> AMQPFrame {
    AMQPFrame::Method(
        1,
        AMQPClass::Basic(ab::AMQPMethod::Deliver(ab::Deliver {
            consumer_tag: CTAG.into(),
            delivery_tag: tag,
            redelivered: false,
            exchange: EXCHANGE.into(),
            routing_key: ROUTING_KEY.into(),
        })),
    )
}

/// What a server built on amq-protocol does per delivery: build the frames from the
/// stored message (cloning its properties and body) and generate them.
fn amq_build_gen(out: &mut Vec<u8>, tag: u64, props: &AMQPProperties, body: &[u8]) -> usize {
    let frames = [
        amq_deliver_method(tag),
        AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: props.clone(),
            },
        ),
        AMQPFrame::Body(1, body.to_vec()),
    ];
    amq_gen_all(out, &frames)
}

/// Generates `frames` into `out` (whose capacity is reused).
fn amq_gen_all(out: &mut Vec<u8>, frames: &[AMQPFrame]) -> usize {
    let mut ctx = WriteContext::from(std::mem::take(out));
    for f in frames {
        ctx = gen_frame(f)(ctx).expect("amq-protocol gen_frame");
    }
    *out = ctx.write;
    out.len()
}

fn set_tag(frame: &mut AMQPFrame, tag: u64) {
    if let AMQPFrame::Method(_, AMQPClass::Basic(ab::AMQPMethod::Deliver(d))) = frame {
        d.delivery_tag = tag;
    }
}

// ---- allocation report and sanity checks ---------------------------------------------

fn alloc_report() {
    let raw = props();
    let aprops = amq_props(&raw);
    println!("allocations per operation (count, bytes), measured outside the timed runs:");
    for body_len in DECODE_SIZES {
        let input = publish_batch(body_len);
        let mut buf = input.clone();
        let mut got = (0, 0);
        let w = allocs_per_op(BATCH, || got = warren_decode(&mut buf));
        assert_eq!(got, (3 * BATCH, BATCH * body_len), "warren decode");
        let a = allocs_per_op(BATCH, || got = amq_decode(&input));
        assert_eq!(got, (3 * BATCH, BATCH * body_len), "amq-protocol decode");
        println!(
            "  decode publish/{body_len}B (per publish = 3 frames): warren {:.2} allocs {:.0} B; amq-protocol {:.2} allocs {:.0} B",
            w.0, w.1, a.0, a.1
        );
    }
    const N: usize = 1000;
    for body_len in ENCODE_SIZES {
        let body = vec![7u8; body_len];
        // the three encoders produce the same bytes
        let mut wout = BytesMut::with_capacity(1 << 20);
        warren_deliver(&mut wout, 123_456, &raw, &body);
        let mut aout = Vec::with_capacity(1 << 20);
        amq_build_gen(&mut aout, 123_456, &aprops, &body);
        assert_eq!(
            &wout[..],
            &aout[..],
            "warren and amq-protocol deliveries differ"
        );

        let w = allocs_per_op(N, || {
            for tag in 0..N as u64 {
                wout.clear();
                warren_deliver(&mut wout, tag, &raw, &body);
            }
        });
        let a = allocs_per_op(N, || {
            for tag in 0..N as u64 {
                aout.clear();
                amq_build_gen(&mut aout, tag, &aprops, &body);
            }
        });
        let mut frames = prebuilt(&aprops, &body);
        let g = allocs_per_op(N, || {
            for tag in 0..N as u64 {
                aout.clear();
                set_tag(&mut frames[0], tag);
                amq_gen_all(&mut aout, &frames);
            }
        });
        println!(
            "  encode deliver/{body_len}B: warren {:.2} allocs {:.0} B; amq-protocol {:.2} allocs {:.0} B; amq-protocol gen-only {:.2} allocs {:.0} B",
            w.0, w.1, a.0, a.1, g.0, g.1
        );
    }
    println!();
}

fn prebuilt(aprops: &AMQPProperties, body: &[u8]) -> [AMQPFrame; 3] {
    [
        amq_deliver_method(0),
        AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: aprops.clone(),
            },
        ),
        AMQPFrame::Body(1, body.to_vec()),
    ]
}

// ---- criterion -----------------------------------------------------------------------

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode publish x100");
    g.throughput(Throughput::Elements(BATCH as u64));
    for body_len in DECODE_SIZES {
        let input = publish_batch(body_len);
        // Both arms get the same untimed setup, a fresh copy of the batch made just
        // before each timed decode (as if just read from the socket), so both read
        // equally warm memory.
        g.bench_function(format!("{body_len}B/warren"), |b| {
            b.iter_batched_ref(|| input.clone(), warren_decode, BatchSize::PerIteration)
        });
        g.bench_function(format!("{body_len}B/amq-protocol"), |b| {
            b.iter_batched_ref(
                || input.clone(),
                |buf| amq_decode(&buf[..]),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

fn encode(c: &mut Criterion) {
    let raw = props();
    let aprops = amq_props(&raw);
    let mut g = c.benchmark_group("encode deliver");
    g.throughput(Throughput::Elements(1));
    for body_len in ENCODE_SIZES {
        let body = vec![7u8; body_len];
        let mut wout = BytesMut::with_capacity(1 << 20);
        g.bench_function(format!("{body_len}B/warren"), |b| {
            b.iter(|| {
                wout.clear();
                warren_deliver(&mut wout, black_box(123_456), &raw, &body)
            })
        });
        let mut aout = Vec::with_capacity(1 << 20);
        g.bench_function(format!("{body_len}B/amq-protocol"), |b| {
            b.iter(|| {
                aout.clear();
                amq_build_gen(&mut aout, black_box(123_456), &aprops, &body)
            })
        });
        let mut frames = prebuilt(&aprops, &body);
        g.bench_function(format!("{body_len}B/amq-protocol gen-only"), |b| {
            b.iter(|| {
                aout.clear();
                set_tag(&mut frames[0], black_box(123_456));
                amq_gen_all(&mut aout, &frames)
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("encode ack");
    let mut out = BytesMut::with_capacity(1 << 16);
    g.bench_function("warren", |b| {
        b.iter(|| {
            out.clear();
            encode_ack(&mut out, 1, black_box(99), false);
            out.len()
        })
    });
    g.finish();
}

criterion_group!(benches, decode, encode);

fn main() {
    alloc_report();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
