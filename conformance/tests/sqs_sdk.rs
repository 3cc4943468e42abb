//! The AWS SDK for Rust (`aws-sdk-sqs`), unchanged, against Warren's SQS endpoint: the calls a
//! worker written for Amazon SQS makes, with its typed answers and errors. Only the endpoint,
//! region and credentials are set, as a local SQS (ElasticMQ) set-up sets them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use warren_conformance::{unique, TestBroker};

fn client(b: &TestBroker) -> Option<Client> {
    let Some(endpoint) = b.sqs_url() else {
        eprintln!("skipped: the SQS API is Warren's, not the external broker's");
        return None;
    };
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("guest", "guest", None, None, "warren"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Some(Client::from_conf(config))
}

fn text(s: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(s)
        .build()
        .expect("attribute")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_written_with_the_rust_sdk_runs_unchanged() {
    let b = TestBroker::start();
    let Some(sqs) = client(&b) else {
        return;
    };
    let dlq_name = unique("sdk-dlq");
    let dlq = sqs
        .create_queue()
        .queue_name(&dlq_name)
        .send()
        .await
        .expect("CreateQueue (the dead-letter queue)")
        .queue_url
        .expect("its URL");
    let arn = sqs
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("GetQueueAttributes")
        .attributes
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .expect("QueueArn");
    let name = unique("sdk-jobs");
    let redrive = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"2"}}"#);
    let url = sqs
        .create_queue()
        .queue_name(&name)
        .attributes(QueueAttributeName::VisibilityTimeout, "30")
        .attributes(QueueAttributeName::RedrivePolicy, redrive)
        .tags("team", "billing")
        .send()
        .await
        .expect("CreateQueue")
        .queue_url
        .expect("its URL");
    let again = sqs
        .get_queue_url()
        .queue_name(&name)
        .send()
        .await
        .expect("GetQueueUrl");
    assert_eq!(again.queue_url.as_deref(), Some(url.as_str()));
    let listed = sqs
        .list_queues()
        .queue_name_prefix("sdk-jobs")
        .send()
        .await
        .expect("ListQueues");
    assert!(listed.queue_urls().contains(&url), "{listed:?}");
    let tags = sqs
        .list_queue_tags()
        .queue_url(&url)
        .send()
        .await
        .expect("ListQueueTags");
    assert_eq!(
        tags.tags.and_then(|t| t.get("team").cloned()).as_deref(),
        Some("billing")
    );

    // A message with attributes of each type, and a batch.
    let sent = sqs
        .send_message()
        .queue_url(&url)
        .message_body("invoice 1")
        .message_attributes("customer", text("acme"))
        .message_attributes(
            "amount",
            MessageAttributeValue::builder()
                .data_type("Number")
                .string_value("42.5")
                .build()
                .expect("attribute"),
        )
        .message_attributes(
            "blob",
            MessageAttributeValue::builder()
                .data_type("Binary")
                .binary_value(Blob::new(vec![0u8, 1, 2, 255]))
                .build()
                .expect("attribute"),
        )
        .send()
        .await
        .expect("SendMessage");
    assert!(sent.message_id.is_some());
    assert!(sent.md5_of_message_attributes.is_some());
    let entries: Vec<SendMessageBatchRequestEntry> = (2..=4)
        .map(|i| {
            SendMessageBatchRequestEntry::builder()
                .id(format!("e{i}"))
                .message_body(format!("invoice {i}"))
                .build()
                .expect("entry")
        })
        .collect();
    let batch = sqs
        .send_message_batch()
        .queue_url(&url)
        .set_entries(Some(entries))
        .send()
        .await
        .expect("SendMessageBatch");
    assert_eq!(batch.successful.len(), 3);
    assert!(batch.failed.is_empty());

    // The worker's loop: receive, handle, delete; invoice 3 fails each time it is tried.
    let mut done = Vec::new();
    let mut tries_of_3 = 0;
    let started = Instant::now();
    while done.len() < 3 || tries_of_3 < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "stuck with {done:?}"
        );
        let got = sqs
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .expect("ReceiveMessage");
        for m in got.messages() {
            let body = m.body().unwrap_or_default().to_owned();
            let handle = m.receipt_handle().expect("a receipt handle");
            if body == "invoice 1" {
                let attrs = m.message_attributes().expect("its attributes");
                assert_eq!(attrs["customer"].string_value(), Some("acme"));
                assert_eq!(attrs["amount"].data_type(), "Number");
                assert_eq!(
                    attrs["blob"].binary_value().map(|b| b.as_ref().to_vec()),
                    Some(vec![0u8, 1, 2, 255])
                );
                let system = m.attributes().expect("system attributes");
                assert_eq!(
                    system
                        .get(&MessageSystemAttributeName::ApproximateReceiveCount)
                        .map(String::as_str),
                    Some("1")
                );
                assert!(system.contains_key(&MessageSystemAttributeName::SentTimestamp));
            }
            if body == "invoice 3" {
                // The worker fails: it gives the message back at once instead of waiting
                // out the visibility timeout.
                tries_of_3 += 1;
                sqs.change_message_visibility()
                    .queue_url(&url)
                    .receipt_handle(handle)
                    .visibility_timeout(0)
                    .send()
                    .await
                    .expect("ChangeMessageVisibility");
                continue;
            }
            sqs.delete_message()
                .queue_url(&url)
                .receipt_handle(handle)
                .send()
                .await
                .expect("DeleteMessage");
            done.push(body);
        }
    }
    done.sort();
    assert_eq!(done, ["invoice 1", "invoice 2", "invoice 4"]);

    // After two receives, the next one moves invoice 3 to the dead-letter queue.
    let next = sqs
        .receive_message()
        .queue_url(&url)
        .send()
        .await
        .expect("ReceiveMessage");
    assert!(next.messages().is_empty(), "{next:?}");
    let got = sqs
        .receive_message()
        .queue_url(&dlq)
        .wait_time_seconds(5)
        .send()
        .await
        .expect("ReceiveMessage on the dead-letter queue");
    let dead = got.messages().first().cloned();
    let dead = dead.expect("a dead letter");
    assert_eq!(dead.body(), Some("invoice 3"));
    assert_eq!(tries_of_3, 2, "tried as often as maxReceiveCount allows");
    let sources = sqs
        .list_dead_letter_source_queues()
        .queue_url(&dlq)
        .send()
        .await
        .expect("ListDeadLetterSourceQueues");
    assert_eq!(sources.queue_urls(), std::slice::from_ref(&url));

    // An unknown queue gets SQS's error, typed.
    let missing = sqs
        .get_queue_url()
        .queue_name(unique("no-such-queue"))
        .send()
        .await
        .expect_err("an unknown queue");
    assert!(
        missing
            .as_service_error()
            .is_some_and(|e| e.is_queue_does_not_exist()),
        "{missing:?}"
    );

    let counts = sqs
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .expect("GetQueueAttributes")
        .attributes
        .unwrap_or_default();
    let counts: BTreeMap<String, String> = counts
        .into_iter()
        .map(|(k, v)| (k.as_str().to_owned(), v))
        .collect();
    assert_eq!(
        counts
            .get("ApproximateNumberOfMessages")
            .map(String::as_str),
        Some("0")
    );
    assert_eq!(
        counts.get("VisibilityTimeout").map(String::as_str),
        Some("30")
    );
    sqs.delete_queue()
        .queue_url(&url)
        .send()
        .await
        .expect("DeleteQueue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_answers_when_the_message_comes_and_fifo_groups_keep_their_order() {
    let b = TestBroker::start();
    let Some(sqs) = client(&b) else {
        return;
    };
    let url = sqs
        .create_queue()
        .queue_name(unique("sdk-poll"))
        .send()
        .await
        .expect("CreateQueue")
        .queue_url
        .expect("its URL");
    let poller = {
        let (sqs, url) = (sqs.clone(), url.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let got = sqs
                .receive_message()
                .queue_url(&url)
                .wait_time_seconds(10)
                .send()
                .await
                .expect("ReceiveMessage");
            (started.elapsed(), got)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqs.send_message()
        .queue_url(&url)
        .message_body("wake up")
        .send()
        .await
        .expect("SendMessage");
    let (waited, got) = poller.await.expect("the poller");
    assert_eq!(
        got.messages().first().and_then(|m| m.body()),
        Some("wake up")
    );
    assert!(
        waited < Duration::from_secs(5),
        "the long poll answered after {waited:?}, not when the message came"
    );

    let fifo = sqs
        .create_queue()
        .queue_name(format!("{}.fifo", unique("sdk-orders")))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(QueueAttributeName::ContentBasedDeduplication, "true")
        .send()
        .await
        .expect("CreateQueue (FIFO)")
        .queue_url
        .expect("its URL");
    for (group, body) in [
        ("a", "a1"),
        ("b", "b1"),
        ("a", "a2"),
        ("a", "a2"),
        ("a", "a3"),
    ] {
        let sent = sqs
            .send_message()
            .queue_url(&fifo)
            .message_group_id(group)
            .message_body(body)
            .send()
            .await
            .expect("SendMessage (FIFO)");
        assert!(sent.sequence_number.is_some());
    }
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let started = Instant::now();
    while order.values().map(Vec::len).sum::<usize>() < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "stuck with {order:?}"
        );
        let got = sqs
            .receive_message()
            .queue_url(&fifo)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await
            .expect("ReceiveMessage (FIFO)");
        for m in got.messages() {
            let group = m
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                .cloned()
                .expect("its group");
            order
                .entry(group)
                .or_default()
                .push(m.body().unwrap_or_default().to_owned());
            sqs.delete_message()
                .queue_url(&fifo)
                .receipt_handle(m.receipt_handle().expect("a handle"))
                .send()
                .await
                .expect("DeleteMessage (FIFO)");
        }
    }
    // The duplicate of a2 (same body, content-based deduplication) was dropped.
    assert_eq!(order["a"], ["a1", "a2", "a3"]);
    assert_eq!(order["b"], ["b1"]);
}
