//! The hot path allocates nothing: decoding publish + header + body frames and encoding
//! deliveries, acks and heartbeats into a buffer with room.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::BytesMut;
use warren_codec::{
    encode_ack, encode_content, encode_deliver, encode_heartbeat, encode_method, properties,
    BasicProperties, BasicPublish, FieldTable, FieldValue, Frame, FrameDecoder, Method,
};

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(|c| c.get())
}

#[test]
fn counter_counts() {
    let before = allocs();
    let v = std::hint::black_box(vec![1u8; 10]);
    assert_eq!(allocs() - before, 1);
    drop(v);
}

fn props() -> bytes::Bytes {
    let mut h = FieldTable::new();
    h.insert("x-trace", FieldValue::long_str("abc"));
    h.insert("n", FieldValue::I32(3));
    BasicProperties {
        content_type: Some("text/plain".into()),
        delivery_mode: Some(2),
        headers: Some(h),
        ..Default::default()
    }
    .encode()
}

#[test]
fn hot_path_does_not_allocate() {
    let props = props();
    let body = vec![42u8; 1000];
    let n = 200;
    let mut input = BytesMut::with_capacity(n * 1200);
    for _ in 0..n {
        encode_method(
            &mut input,
            1,
            &Method::from(BasicPublish {
                exchange: "amq.topic".into(),
                routing_key: "a.b.c".into(),
                ..Default::default()
            }),
        );
        encode_content(&mut input, 1, 60, &props, &body, 131072);
    }
    let mut dec = FrameDecoder::new(131072);
    // the first split turns the buffer into shared storage: one allocation
    let first = dec.decode(&mut input).unwrap().unwrap();
    assert!(matches!(first, Frame::Method { .. }));
    drop(first);

    let before = allocs();
    let mut frames = 0;
    let mut persistent = 0;
    while let Some(f) = dec.decode(&mut input).unwrap() {
        match &f {
            Frame::Header { header, .. } => {
                if properties::is_persistent(&header.properties) {
                    persistent += 1;
                }
                assert!(properties::headers_raw(&header.properties).is_some());
            }
            Frame::Method {
                method: Method::BasicPublish(p),
                ..
            } => {
                assert_eq!(p.routing_key, "a.b.c");
            }
            _ => {}
        }
        frames += 1;
        drop(f);
    }
    let decode_allocs = allocs() - before;
    assert_eq!(frames, 3 * n - 1);
    assert_eq!(persistent, n);
    assert_eq!(decode_allocs, 0, "decoding allocated");

    let mut out = BytesMut::with_capacity(4 << 20);
    let before = allocs();
    for tag in 0..n as u64 {
        encode_deliver(
            &mut out,
            1,
            "ctag-1",
            tag,
            false,
            "amq.topic",
            "a.b.c",
            &props,
            &body,
            131072,
        );
        encode_ack(&mut out, 1, tag, false);
        encode_heartbeat(&mut out);
    }
    assert_eq!(allocs() - before, 0, "encoding allocated");
}
