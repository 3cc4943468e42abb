//! Transactions (tx.select, tx.commit): RabbitMQ checks each publish of a transaction as it
//! comes, and a commit either answers commit-ok with everything applied or fails. These run
//! against RabbitMQ too.

use warren_conformance::raw::protocol::{queue, tx, AMQPClass};
use warren_conformance::raw::types::AMQPValue;
use warren_conformance::raw::{m, QueueFlags, Raw};
use warren_conformance::{unique, TestBroker};

async fn ready(raw: &mut Raw, channel: u16, q: &str) -> u32 {
    let passive = QueueFlags {
        passive: true,
        ..Default::default()
    };
    match raw.call(channel, m::queue_declare(q, passive)).await {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok.message_count,
        other => panic!("{other:?}"),
    }
}

async fn tx_select(raw: &mut Raw, channel: u16) {
    match raw.call(channel, m::tx_select()).await {
        AMQPClass::Tx(tx::AMQPMethod::SelectOk(_)) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_publish_to_a_missing_exchange_closes_the_channel_before_the_commit() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("tx-missing-x");
    raw.declare_queue(1, &q).await;
    tx_select(&mut raw, 1).await;
    raw.publish(1, "", &q, false, Default::default(), b"first")
        .await;
    let missing = unique("tx-nope");
    raw.publish(1, &missing, "k", false, Default::default(), b"second")
        .await;
    // No tx.commit sent: the error comes from the publish itself.
    raw.expect_channel_close(
        1,
        404,
        &format!("NOT_FOUND - no exchange '{missing}' in vhost '/'"),
        60,
        40,
    )
    .await;
    raw.channel_open(2).await;
    assert_eq!(
        ready(&mut raw, 2, &q).await,
        0,
        "a message of the failed transaction was delivered"
    );
    raw.close().await;
}

#[tokio::test]
async fn a_commit_a_full_queue_refuses_is_not_answered_with_commit_ok() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let full = unique("tx-full");
    let q = unique("tx-q");
    let args = m::table(&[
        ("x-max-length", AMQPValue::LongInt(1)),
        ("x-overflow", AMQPValue::LongString("reject-publish".into())),
    ]);
    raw.call(1, m::queue_declare_args(&full, QueueFlags::default(), args))
        .await;
    raw.declare_queue(1, &q).await;
    raw.publish(1, "", &full, false, Default::default(), b"fills it")
        .await;
    raw.wait_ready(1, &full, 1).await;
    raw.channel_open(2).await;
    tx_select(&mut raw, 2).await;
    raw.publish(2, "", &q, false, Default::default(), b"accepted")
        .await;
    raw.publish(2, "", &full, false, Default::default(), b"refused")
        .await;
    raw.send(2, m::tx_commit()).await;
    raw.expect_channel_close(
        2,
        406,
        "PRECONDITION_FAILED - partial tx completion",
        90,
        20,
    )
    .await;
    // Not atomic across queues, in RabbitMQ either: what a queue took stays.
    raw.wait_ready(1, &q, 1).await;
    assert_eq!(ready(&mut raw, 1, &full).await, 1);
    raw.close().await;
}
