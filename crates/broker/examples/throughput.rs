//! Rough single-thread throughput of the broker core: publish, dispatch, settle, and what it
//! allocates per message once warm (a counting allocator around the system's).
//! `cargo run --release -p warren-broker --example throughput`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, CreditGroup, DeclareQueue, Delivery, Message};
use warren_codec::FieldTable;

/// The system allocator, counting allocations (reallocations included) and their bytes.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

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
        away: None,
    };
    let keys: Vec<String> = (0..100).map(|i| format!("a.{i}.x.y")).collect();
    let mut deliveries: Vec<Delivery> = Vec::with_capacity(1000);
    let mut run = |b: &mut Broker, n: u64| -> Result<u64, warren_codec::AmqpError> {
        let mut delivered = 0u64;
        for i in 0..n {
            let key = &keys[(i % 100) as usize];
            b.publish("/", "amq.topic", key, msg.clone(), i)?;
            if i % 100 == 99 {
                delivered += dispatch_and_settle(b, &mut deliveries);
            }
        }
        Ok(delivered + dispatch_and_settle(b, &mut deliveries))
    };
    // Warm: every queue's structures at their working size.
    run(&mut b, 100_000)?;
    let n = 1_000_000u64;
    let (allocs, bytes) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        ALLOCATED.load(Ordering::Relaxed),
    );
    let start = Instant::now();
    let delivered = run(&mut b, n)?;
    let el = start.elapsed();
    let allocs = ALLOCATIONS.load(Ordering::Relaxed) - allocs;
    let bytes = ALLOCATED.load(Ordering::Relaxed) - bytes;
    assert_eq!(delivered, n, "every message delivered");
    println!(
        "{n} publish+deliver+settle in {el:?}: {:.0}/s; {:.2} allocations and {:.0} bytes \
         allocated per message once warm",
        n as f64 / el.as_secs_f64(),
        allocs as f64 / n as f64,
        bytes as f64 / n as f64,
    );
    Ok(())
}
