//! Transactions: all of a commit or nothing of it, and RabbitMQ's errors at the moment it
//! raises them.

use super::*;

impl Client {
    fn tx_select(&mut self, channel: u16) {
        self.send(channel, TxSelect {});
        assert!(matches!(self.recv_method(), Method::TxSelectOk(_)));
    }

    fn publish_to(&mut self, channel: u16, exchange: &str, routing_key: &str, body: &[u8]) {
        let publish = BasicPublish {
            exchange: ShortStr::from_string(exchange.to_string()),
            routing_key: ShortStr::from_string(routing_key.to_string()),
            ..Default::default()
        };
        self.publish_header(
            channel,
            publish,
            body.len() as u64,
            BasicProperties::default().encode(),
        );
        self.node.handle_frame(
            CONN,
            Frame::Body {
                channel,
                payload: Bytes::copy_from_slice(body),
            },
            self.now,
        );
    }

    /// Ready messages of queue `name` in vhost "/".
    fn ready(&self, name: &str) -> u64 {
        let broker = self.node.broker();
        let id = broker.queue_id("/", name).expect("queue");
        u64::from(broker.queue_info(id).expect("queue").message_count)
    }

    fn ack(&mut self, channel: u16, delivery_tag: u64) {
        self.send(
            channel,
            BasicAck {
                delivery_tag,
                multiple: false,
            },
        );
    }
}

#[test]
fn a_publish_to_a_missing_exchange_fails_at_once_and_nothing_of_its_transaction_is_applied() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.tx_select(1);
    c.publish_to(1, "", "q", b"first");
    c.publish_to(1, "nope", "k", b"second");
    // RabbitMQ checks the exchange at basic.publish, in a transaction too: the channel
    // closes there, and the commit never comes.
    expect_channel_close(
        c.recv_method(),
        404,
        "NOT_FOUND - no exchange 'nope' in vhost '/'",
        60,
        40,
    );
    c.send(1, TxCommit {});
    c.send(1, ChannelCloseOk {});
    assert!(c.frames().is_empty());
    assert_eq!(c.ready("q"), 0, "the first publish was applied");
}

#[test]
fn an_exchange_deleted_before_the_commit_fails_the_whole_commit() {
    let mut c = Client::open();
    c.channel(1);
    c.channel(2);
    c.declare(1, "q");
    declare_exchange_works(&mut c, 1, "x");
    c.tx_select(1);
    c.publish_to(1, "", "q", b"first");
    c.publish_to(1, "x", "k", b"second");
    c.send(
        2,
        ExchangeDelete {
            exchange: ShortStr::from("x"),
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::ExchangeDeleteOk(_)));
    c.send(1, TxCommit {});
    expect_channel_close(
        c.recv_method(),
        404,
        "NOT_FOUND - no exchange 'x' in vhost '/'",
        90,
        20,
    );
    assert_eq!(c.ready("q"), 0, "half of the commit was applied");
}

#[test]
fn a_tag_acked_in_a_transaction_is_the_transactions_until_commit_or_rollback() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.publish(1, "q", b"one");
    c.publish(1, "q", b"two");
    c.consume(1, "q", false);
    assert_eq!(c.deliveries().len(), 2);
    c.tx_select(1);
    c.ack(1, 1);
    // A rollback gives the tag back: it can be acked again.
    c.send(1, TxRollback {});
    assert!(matches!(c.recv_method(), Method::TxRollbackOk(_)));
    c.ack(1, 1);
    c.publish_to(1, "", "q", b"three");
    assert!(c.frames().is_empty());
    // Acked once in this transaction already: refused now, as RabbitMQ does, not halfway
    // through the commit after the publish.
    c.ack(1, 1);
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - unknown delivery tag 1",
        60,
        80,
    );
    c.send(1, TxCommit {});
    c.send(1, ChannelCloseOk {});
    // Nothing committed: both deliveries are back (tag 1 from the transaction that held it),
    // the publish never happened.
    assert_eq!(c.ready("q"), 2);
}

#[test]
fn a_message_a_full_queue_refuses_fails_the_commit() {
    let mut c = Client::open();
    c.channel(1);
    let mut args = FieldTable::default();
    args.insert(ShortStr::from("x-max-length"), FieldValue::I32(1));
    args.insert(
        ShortStr::from("x-overflow"),
        FieldValue::long_str("reject-publish"),
    );
    c.declare_args(1, "full", args);
    c.declare(1, "q");
    c.publish(1, "full", b"fills it");
    c.tx_select(1);
    c.publish_to(1, "", "q", b"accepted");
    c.publish_to(1, "", "full", b"refused");
    c.send(1, TxCommit {});
    // As RabbitMQ: what was accepted stays, and the commit is not answered with commit-ok.
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - partial tx completion",
        90,
        20,
    );
    assert_eq!((c.ready("q"), c.ready("full")), (1, 1));
}

#[test]
fn a_publish_in_another_users_name_is_refused_at_once() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.tx_select(1);
    c.publish_to(1, "", "q", b"first");
    let props = BasicProperties {
        user_id: Some(ShortStr::from("someone-else")),
        ..Default::default()
    }
    .encode();
    c.publish_props(1, "q", b"second", props);
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - user_id property set to 'someone-else' but authenticated user was 'guest'",
        60,
        40,
    );
    c.send(1, ChannelCloseOk {});
    assert_eq!(c.ready("q"), 0);
    // Its own name is accepted.
    c.channel(2);
    let props = BasicProperties {
        user_id: Some(ShortStr::from("guest")),
        ..Default::default()
    }
    .encode();
    c.publish_props(2, "q", b"mine", props);
    assert!(c.frames().is_empty());
    assert_eq!(c.ready("q"), 1);
}
