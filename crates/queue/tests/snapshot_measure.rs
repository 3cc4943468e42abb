//! What a snapshot of a deep queue costs: bytes per ready 1 KiB message, and the time to write
//! and read back 100,000 of them. Prints only; run it in a release build:
//! `cargo test --release -p warren-queue --test snapshot_measure -- --ignored --nocapture`.

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use warren_codec::ShortStr;
use warren_queue::machine::{Command, Meta, MsgMeta, QueueMachine};
use warren_queue::Message;

const MESSAGES: u64 = 100_000;
const BODY: usize = 1024;

#[test]
#[ignore = "a measurement: run in a release build with --ignored --nocapture"]
fn snapshot_of_100k_ready_1kib_messages() {
    let mut m = QueueMachine::<Message>::new();
    let body = Bytes::from(vec![7u8; BODY]);
    let mut effects = Vec::new();
    for i in 0..MESSAGES {
        let meta = Meta {
            index: i + 1,
            now_ms: 1_000,
        };
        // As a publish arrives: the default exchange, the queue's name as routing key, and
        // delivery mode 2 as the only property.
        let message = Message {
            exchange: ShortStr::from_static(""),
            routing_key: ShortStr::from_static("orders"),
            properties: Bytes::from_static(&[0x10, 0x00, 0x02]),
            body: body.clone(),
            persistent: true,
            store_key: None,
            away: None,
        };
        let meta_msg = MsgMeta {
            size: BODY as u64,
            ..MsgMeta::default()
        };
        m.apply(
            meta,
            Command::Enqueue {
                message,
                meta: meta_msg,
            },
            &mut effects,
        );
    }
    // What a node's lock is held for when the snapshot is written elsewhere: a copy of the
    // machine (the bodies shared, not copied).
    let started = Instant::now();
    let copy = m.clone();
    let cloned = started.elapsed();
    drop(copy);
    let mut out = BytesMut::new();
    let started = Instant::now();
    m.snapshot(&mut out).expect("nothing is paged");
    let written = started.elapsed();
    let bytes = out.freeze();
    let started = Instant::now();
    let back = QueueMachine::restore_snapshot(bytes.clone()).expect("its own snapshot");
    let read = started.elapsed();
    assert_eq!(back.digest(), m.digest());
    let per = bytes.len() as f64 / MESSAGES as f64;
    println!(
        "{MESSAGES} ready messages of {BODY} B: snapshot {} B, {per:.1} B per message \
         ({:.1} B beside the body); copied in {:.1} ms, written in {:.1} ms, read back in {:.1} ms",
        bytes.len(),
        per - BODY as f64,
        cloned.as_secs_f64() * 1e3,
        written.as_secs_f64() * 1e3,
        read.as_secs_f64() * 1e3,
    );
}
