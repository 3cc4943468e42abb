//! A message that says it was delivered before (`x-redelivered: true`, what `warren migrate`
//! sets on a message its source had delivered) goes out as redelivered the first time, whether
//! it was enqueued or restored from the store; one without the header does not.

use bytes::Bytes;
use warren_codec::properties::BasicProperties;
use warren_codec::table::{FieldTable, FieldValue};
use warren_codec::ShortStr;
use warren_queue::machine::{Command, Effect, Meta, MsgMeta, QueueMachine};
use warren_queue::{Message, REDELIVERED_HEADER};

fn message(marked: bool) -> Message {
    let mut headers = FieldTable::new();
    headers.insert(ShortStr::from_static("tenant"), FieldValue::Bool(true));
    if marked {
        headers.insert(
            ShortStr::from_static(REDELIVERED_HEADER),
            FieldValue::Bool(true),
        );
    }
    Message {
        exchange: ShortStr::from_static(""),
        routing_key: ShortStr::from_static("q"),
        properties: BasicProperties {
            headers: Some(headers),
            ..BasicProperties::default()
        }
        .encode(),
        body: Bytes::from_static(b"body"),
        persistent: true,
        store_key: None,
        away: None,
    }
}

fn meta() -> MsgMeta {
    MsgMeta {
        size: 4,
        ..MsgMeta::default()
    }
}

/// basic.get's delivery: its redelivered flag.
fn get(m: &mut QueueMachine<Message>, index: u64) -> bool {
    let mut effects = Vec::new();
    m.apply(
        Meta { index, now_ms: 0 },
        Command::Get { no_ack: true },
        &mut effects,
    );
    effects
        .iter()
        .find_map(|e| match e {
            Effect::Deliver(d) => Some(d.redelivered),
            _ => None,
        })
        .expect("a delivery")
}

#[test]
fn an_enqueued_message_with_the_header_goes_out_redelivered() {
    let mut m = QueueMachine::new();
    let mut effects = Vec::new();
    for (i, marked) in [true, false].into_iter().enumerate() {
        m.apply(
            Meta {
                index: i as u64 + 1,
                now_ms: 0,
            },
            Command::Enqueue {
                message: message(marked),
                meta: meta(),
            },
            &mut effects,
        );
    }
    assert!(get(&mut m, 3), "marked");
    assert!(!get(&mut m, 4), "not marked");
}

#[test]
fn a_restored_message_with_the_header_goes_out_redelivered() {
    let mut m = QueueMachine::new();
    let mut effects = Vec::new();
    for (id, marked) in [(1u64, true), (2, false)] {
        m.apply(
            Meta {
                index: id,
                now_ms: 0,
            },
            Command::Restore {
                msg_id: id,
                message: message(marked),
                meta: meta(),
                delivery_count: 0,
                redelivered: false,
                retry_at: None,
            },
            &mut effects,
        );
    }
    assert!(get(&mut m, 3), "marked");
    assert!(!get(&mut m, 4), "not marked");
}
