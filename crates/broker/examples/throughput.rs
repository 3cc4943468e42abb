//! Rough single-thread throughput of the broker core: publish, dispatch, settle.
//! `cargo run --release -p warren-broker --example throughput`

use std::time::Instant;

use bytes::Bytes;
use warren_broker::{
    Broker, BrokerConfig, ConsumerKey, DeclareQueue, Delivery, DeliverySink, Message,
};
use warren_codec::FieldTable;

struct Sink(Vec<(u64, warren_broker::QueueId)>);

impl DeliverySink for Sink {
    fn has_credit(&mut self, _: &ConsumerKey) -> bool {
        self.0.len() < 1000
    }
    fn deliver(&mut self, _: &ConsumerKey, d: Delivery) {
        self.0.push((d.msg_id, d.queue));
    }
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
            ConsumerKey {
                conn: 1,
                channel: 1,
                tag: warren_codec::ShortStr::from_string(format!("t{i}")),
            },
            false,
            false,
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
    };
    let keys: Vec<String> = (0..100).map(|i| format!("a.{i}.x.y")).collect();
    let n = 1_000_000u64;
    let mut sink = Sink(Vec::with_capacity(1000));
    let start = Instant::now();
    for i in 0..n {
        let key = &keys[(i % 100) as usize];
        b.publish("/", "amq.topic", key, msg.clone(), i)?;
        if i % 100 == 99 {
            b.dispatch(&mut sink);
            for (id, q) in sink.0.drain(..) {
                b.settle(q, id);
            }
            b.channel_credit_changed(1, 1);
        }
    }
    b.dispatch(&mut sink);
    let el = start.elapsed();
    println!(
        "{n} publish+deliver+settle in {el:?}: {:.0}/s",
        n as f64 / el.as_secs_f64()
    );
    Ok(())
}
