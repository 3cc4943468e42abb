//! Rough single-thread throughput of the broker core: publish, dispatch, settle.
//! `cargo run --release -p warren-broker --example throughput`

use std::time::Instant;

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, CreditGroup, DeclareQueue, Delivery, Message};
use warren_codec::FieldTable;

/// Runs every queue's checkouts until none has work, then acks what was delivered (the
/// receipts give the consumers their prefetch back). Returns how many were delivered.
fn dispatch_and_settle(b: &mut Broker, deliveries: &mut Vec<Delivery>) -> u64 {
    while b.needs_dispatch() {
        b.dispatch_one(deliveries);
    }
    let n = deliveries.len() as u64;
    for d in deliveries.drain(..) {
        b.settle(d.queue, d.receipt);
    }
    n
}

fn main() -> Result<(), warren_codec::AmqpError> {
    let mut b = Broker::new(BrokerConfig::default());
    let none = FieldTable::new();
    let mut queues = Vec::new();
    for i in 0..100 {
        let name = format!("q{i}");
        let d = b.declare_queue(
            "/",
            DeclareQueue {
                name: warren_codec::ShortStr::from_string(name.clone()),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                arguments: FieldTable::new(),
            },
            1,
        )?;
        b.bind_queue("/", &name, "amq.topic", &format!("a.{i}.#"), &none, 1)?;
        b.consume(
            "/",
            &name,
            CreditGroup {
                conn: 1,
                channel: 1,
            },
            warren_codec::ShortStr::from_string(format!("t{i}")),
            false,
            false,
            // Each consumer may hold up to 1000 unacked messages.
            1000,
            &none,
        )?;
        queues.push(d.queue);
    }
    let msg = Message {
        exchange: "amq.topic".into(),
        routing_key: "".into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from(vec![0u8; 100]),
        persistent: false,
        store_key: None,
    };
    let keys: Vec<String> = (0..100).map(|i| format!("a.{i}.x.y")).collect();
    let n = 1_000_000u64;
    let mut deliveries: Vec<Delivery> = Vec::with_capacity(1000);
    let mut delivered = 0u64;
    let start = Instant::now();
    for i in 0..n {
        let key = &keys[(i % 100) as usize];
        b.publish("/", "amq.topic", key, msg.clone(), i)?;
        if i % 100 == 99 {
            delivered += dispatch_and_settle(&mut b, &mut deliveries);
        }
    }
    delivered += dispatch_and_settle(&mut b, &mut deliveries);
    let el = start.elapsed();
    assert_eq!(delivered, n, "every message delivered");
    println!(
        "{n} publish+deliver+settle in {el:?}: {:.0}/s",
        n as f64 / el.as_secs_f64()
    );
    Ok(())
}
