//! Start-up: the broker accepts connections and completes their handshake while it is still
//! bringing queues back from disk, and a client's first queue command waits until that is over
//! (so it never sees a queue half restored).

use std::time::{Duration, Instant};

use warren_conformance::raw::frame::AMQPFrame;
use warren_conformance::raw::protocol::{queue, AMQPClass};
use warren_conformance::raw::{encode, m, QueueFlags, Raw};
use warren_conformance::{unique, TestBroker};

async fn ready(raw: &mut Raw, name: &str) -> u32 {
    let passive = QueueFlags {
        passive: true,
        ..QueueFlags::default()
    };
    match raw.call(1, m::queue_declare(name, passive)).await {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok.message_count,
        other => panic!("expected queue.declare-ok, got {other:?}"),
    }
}

#[tokio::test]
async fn connections_are_served_while_queues_are_recovered() {
    // 40 ms before each of 50 queues: recovery takes at least 2 s.
    let mut broker = TestBroker::start_with(&["--test-recovery-step-ms", "40"]);
    if broker.is_external() {
        eprintln!("SKIPPED: restarts the spawned broker");
        return;
    }
    const QUEUES: u32 = 50;
    const PER_QUEUE: u32 = 20;
    let prefix = unique("recovering");
    {
        let mut raw = broker.raw().await;
        raw.channel_open(1).await;
        let durable = QueueFlags {
            durable: true,
            nowait: true,
            ..QueueFlags::default()
        };
        let mut batch = Vec::new();
        for q in 0..QUEUES {
            let name = format!("{prefix}-{q}");
            batch.extend(encode(&AMQPFrame::Method(
                1,
                m::queue_declare(&name, durable),
            )));
            for i in 0..PER_QUEUE {
                let props =
                    warren_conformance::raw::AMQPProperties::default().with_delivery_mode(2);
                let body = format!("{q}-{i}");
                batch.extend(raw.encode_publish(1, "", &name, false, props, body.as_bytes()));
            }
        }
        raw.send_bytes(&batch).await;
        let last = format!("{prefix}-{}", QUEUES - 1);
        while ready(&mut raw, &last).await < PER_QUEUE {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // A clean stop writes everything; the restart recovers 50 queues, slowly.
    broker.restart(false);
    let started = Instant::now();
    let mut raw = broker.raw().await;
    let handshake = started.elapsed();
    assert!(
        !broker.output().contains("recovered durable state"),
        "the handshake waited for recovery ({handshake:?})"
    );
    assert!(
        handshake < Duration::from_secs(1),
        "handshake took {handshake:?}"
    );
    // The first queue command waits for the end of recovery, and sees every message.
    raw.channel_open(1).await;
    for q in [0, QUEUES - 1] {
        assert_eq!(
            ready(&mut raw, &format!("{prefix}-{q}")).await,
            PER_QUEUE,
            "queue {q}"
        );
    }
    assert!(broker.output().contains("recovered durable state"));
    assert!(started.elapsed() >= Duration::from_millis(40 * u64::from(QUEUES)));
}
