#!/usr/bin/env python3
"""SQS flows driven by boto3, unchanged, against Warren's SQS endpoint, and the same queues over AMQP with pika.
Usage: python3 sqs_flows.py http://127.0.0.1:9324 amqp://guest:guest@127.0.0.1:5672/%2f

Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" on the first failure.
"""

import hashlib
import json
import struct
import sys
import threading
import time
import traceback
import uuid

try:
    import boto3
    import pika
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import: {e} (scripts/test installs boto3 and pika into clients/.deps/python)", file=sys.stderr)
    sys.exit(2)

ENDPOINT = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:9324"
AMQP_URL = sys.argv[2] if len(sys.argv) > 2 else "amqp://guest:guest@127.0.0.1:5672/%2f"


def client():
    # guest/guest: a Warren user's name and password are an access key id and its secret.
    return boto3.client(
        "sqs",
        endpoint_url=ENDPOINT,
        region_name="us-east-1",
        aws_access_key_id="guest",
        aws_secret_access_key="guest",
    )


def unique(prefix):
    return f"{prefix}-boto-{uuid.uuid4().hex[:12]}"


def md5_of_attributes(attrs):
    """MD5OfMessageAttributes as AWS's developer guide describes it (boto3 does not check it)."""
    h = hashlib.md5()

    def field(b):
        h.update(struct.pack(">I", len(b)))
        h.update(b)

    for name in sorted(attrs):
        a = attrs[name]
        field(name.encode())
        field(a["DataType"].encode())
        if "BinaryValue" in a:
            h.update(b"\x02")
            field(a["BinaryValue"])
        else:
            h.update(b"\x01")
            field(a["StringValue"].encode())
    return h.hexdigest()


FLOWS = []


def flow(f):
    FLOWS.append(f)
    return f


@flow
def create_send_receive_delete():
    sqs = client()
    url = sqs.create_queue(QueueName=unique("jobs"), Attributes={"VisibilityTimeout": "30"})["QueueUrl"]
    assert "/000000000000/" in url, url
    attrs = {
        "kind": {"DataType": "String", "StringValue": "report"},
        "tries": {"DataType": "Number", "StringValue": "3"},
        "blob": {"DataType": "Binary", "BinaryValue": b"\x00\x01\xff"},
    }
    sent = sqs.send_message(QueueUrl=url, MessageBody="hello", MessageAttributes=attrs)
    assert sent["MD5OfMessageBody"] == hashlib.md5(b"hello").hexdigest(), sent
    assert sent["MD5OfMessageAttributes"] == md5_of_attributes(attrs), sent
    got = sqs.receive_message(
        QueueUrl=url, MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"], WaitTimeSeconds=1
    )["Messages"]
    assert len(got) == 1, got
    m = got[0]
    assert m["Body"] == "hello" and m["MessageId"] == sent["MessageId"], m
    assert m["MessageAttributes"]["blob"]["BinaryValue"] == b"\x00\x01\xff", m
    assert m["MD5OfMessageAttributes"] == md5_of_attributes(m["MessageAttributes"]), m
    assert m["Attributes"]["ApproximateReceiveCount"] == "1", m
    assert int(m["Attributes"]["SentTimestamp"]) > 0, m
    counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert counts["ApproximateNumberOfMessagesNotVisible"] == "1", counts
    sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert counts["ApproximateNumberOfMessagesNotVisible"] == "0", counts
    assert sqs.get_queue_url(QueueName=url.rsplit("/", 1)[1])["QueueUrl"] == url
    sqs.delete_queue(QueueUrl=url)
    try:
        sqs.get_queue_url(QueueName=url.rsplit("/", 1)[1])
        raise AssertionError("a deleted queue was found")
    except sqs.exceptions.QueueDoesNotExist:
        pass


@flow
def long_poll_answers_at_the_send():
    sqs = client()
    url = sqs.create_queue(QueueName=unique("poll"))["QueueUrl"]

    sender = client()

    def later():
        time.sleep(0.3)
        # From the moment the send starts: the poll may answer before send_message returns.
        sent_at.append(time.monotonic())
        sender.send_message(QueueUrl=url, MessageBody="wake")

    sent_at = []
    t = threading.Thread(target=later)
    started = time.monotonic()
    t.start()
    got = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5).get("Messages", [])
    answered = time.monotonic()
    t.join()
    assert [m["Body"] for m in got] == ["wake"], got
    # Within 0.5 s of the send, asserted loosely (a loaded machine): far from the 5 s of the poll.
    lag = answered - sent_at[0]
    assert lag < 2.0 and answered - started < 4.0, (lag, answered - started)
    print(f"# long poll answered {lag * 1000:.0f} ms after the send began", flush=True)


@flow
def visibility_change_and_batches():
    sqs = client()
    url = sqs.create_queue(QueueName=unique("vis"))["QueueUrl"]
    r = sqs.send_message_batch(
        QueueUrl=url, Entries=[{"Id": str(i), "MessageBody": f"m{i}"} for i in range(3)]
    )
    assert len(r["Successful"]) == 3, r
    got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)["Messages"]
    assert len(got) == 3, got
    # One visible again at once, the others given more time.
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=got[0]["ReceiptHandle"], VisibilityTimeout=0)
    again = sqs.receive_message(
        QueueUrl=url, MaxNumberOfMessages=10, MessageSystemAttributeNames=["ApproximateReceiveCount"]
    )["Messages"]
    assert [m["Body"] for m in again] == [got[0]["Body"]], again
    assert again[0]["Attributes"]["ApproximateReceiveCount"] == "2", again
    r = sqs.delete_message_batch(
        QueueUrl=url,
        Entries=[{"Id": "a", "ReceiptHandle": again[0]["ReceiptHandle"]}]
        + [{"Id": f"b{i}", "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got[1:])],
    )
    assert len(r["Successful"]) == 3, r
    counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert counts["ApproximateNumberOfMessages"] == "0", counts
    assert counts["ApproximateNumberOfMessagesNotVisible"] == "0", counts


@flow
def redrive_to_the_dead_letter_queue():
    sqs = client()
    dlq = sqs.create_queue(QueueName=unique("dlq"))["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    url = sqs.create_queue(
        QueueName=unique("src"),
        Attributes={"RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "3"})},
    )["QueueUrl"]
    assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [url]
    assert sqs.list_dead_letter_source_queues(QueueUrl=url)["queueUrls"] == []
    sqs.send_message(QueueUrl=url, MessageBody="poison")
    for n in range(1, 4):
        got = sqs.receive_message(
            QueueUrl=url, VisibilityTimeout=0, MessageSystemAttributeNames=["ApproximateReceiveCount"]
        )["Messages"]
        assert got[0]["Attributes"]["ApproximateReceiveCount"] == str(n), got
    assert "Messages" not in sqs.receive_message(QueueUrl=url), "still in the source queue"
    dead = sqs.receive_message(QueueUrl=dlq, WaitTimeSeconds=1)["Messages"]
    assert [m["Body"] for m in dead] == ["poison"], dead


@flow
def redrive_policy_and_tags_set_on_a_queue_in_use():
    """The common set-up order: the queue first, its DLQ and redrive policy after, with messages already in it."""
    sqs = client()
    url = sqs.create_queue(QueueName=unique("late-redrive"), tags={"team": "billing"})["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="already queued")
    dlq = sqs.create_queue(QueueName=unique("late-dlq"))["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sqs.set_queue_attributes(
        QueueUrl=url,
        Attributes={
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "2"}),
            "VisibilityTimeout": "0",
            "ReceiveMessageWaitTimeSeconds": "1",
        },
    )
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert got["VisibilityTimeout"] == "0", got
    assert got["ReceiveMessageWaitTimeSeconds"] == "1", got
    assert json.loads(got["RedrivePolicy"])["maxReceiveCount"] == 2, got
    assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [url]
    for _ in range(2):
        assert len(sqs.receive_message(QueueUrl=url)["Messages"]) == 1
    assert "Messages" not in sqs.receive_message(QueueUrl=url), "still in the source queue"
    dead = sqs.receive_message(QueueUrl=dlq, WaitTimeSeconds=2)["Messages"]
    assert [m["Body"] for m in dead] == ["already queued"], dead
    try:
        sqs.set_queue_attributes(QueueUrl=url, Attributes={"MessageRetentionPeriod": "30"})
        raise AssertionError("a retention period under 60 s was taken")
    except sqs.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "InvalidAttributeValue", e.response
    sqs.tag_queue(QueueUrl=url, Tags={"env": "staging", "team": "payments"})
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"team": "payments", "env": "staging"}
    sqs.untag_queue(QueueUrl=url, TagKeys=["team"])
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"env": "staging"}
    sqs.untag_queue(QueueUrl=url, TagKeys=["env"])
    assert "Tags" not in sqs.list_queue_tags(QueueUrl=url)
    sqs.delete_queue(QueueUrl=url)
    sqs.delete_queue(QueueUrl=dlq)


@flow
def dead_letter_queue_redriven_by_a_message_move_task():
    sqs = client()
    dlq = sqs.create_queue(QueueName=unique("move-dlq"))["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    url = sqs.create_queue(
        QueueName=unique("move-src"),
        Attributes={
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "1"}),
            "VisibilityTimeout": "0",
        },
    )["QueueUrl"]
    for i in range(3):
        sqs.send_message(QueueUrl=url, MessageBody=f"job-{i}")
    for _ in range(10):
        if "Messages" not in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10):
            break
    handle = sqs.start_message_move_task(SourceArn=dlq_arn)["TaskHandle"]
    for _ in range(200):
        task = sqs.list_message_move_tasks(SourceArn=dlq_arn)["Results"][0]
        if task["Status"] not in ("RUNNING", "CANCELLING"):
            break
        time.sleep(0.025)
    assert task["Status"] == "COMPLETED" and task["ApproximateNumberOfMessagesMoved"] == 3, task
    try:
        sqs.cancel_message_move_task(TaskHandle=handle)
        raise AssertionError("a finished task was cancelled")
    except sqs.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "AWS.SimpleQueueService.UnsupportedOperation", e.response
    got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=30)["Messages"]
    assert sorted(m["Body"] for m in got) == ["job-0", "job-1", "job-2"], got
    sqs.delete_queue(QueueUrl=url)
    sqs.delete_queue(QueueUrl=dlq)


@flow
def amqp_publish_received_by_boto3_and_back():
    sqs = client()
    name = unique("shared")
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish(
        "", name, b"from pika", pika.BasicProperties(delivery_mode=2, headers={"kind": "report", "n": 7})
    )
    got = sqs.receive_message(QueueUrl=url, MessageAttributeNames=["All"], WaitTimeSeconds=2)["Messages"]
    assert got[0]["Body"] == "from pika", got
    assert got[0]["MessageAttributes"]["kind"] == {"DataType": "String", "StringValue": "report"}, got
    assert got[0]["MessageAttributes"]["n"] == {"DataType": "Number", "StringValue": "7"}, got
    sqs.delete_message(QueueUrl=url, ReceiptHandle=got[0]["ReceiptHandle"])
    sqs.send_message(
        QueueUrl=url, MessageBody="from boto3", MessageAttributes={"kind": {"DataType": "String", "StringValue": "x"}}
    )
    method, props, body = None, None, None
    deadline = time.monotonic() + 10
    while method is None and time.monotonic() < deadline:
        method, props, body = ch.basic_get(name, auto_ack=False)
    assert body == b"from boto3", body
    assert props.headers["kind"] == b"x" or props.headers["kind"] == "x", props.headers
    ch.basic_ack(method.delivery_tag)
    conn.close()
    counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert counts["ApproximateNumberOfMessages"] == "0", counts


@flow
def fifo_queue_orders_groups_and_drops_duplicates():
    sqs = client()
    try:
        sqs.create_queue(QueueName=unique("nosuffix"), Attributes={"FifoQueue": "true"})
        raise AssertionError("a FIFO queue without .fifo was created")
    except sqs.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "InvalidParameterValue", e.response
    name = unique("orders") + ".fifo"
    url = sqs.create_queue(QueueName=name, Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"})[
        "QueueUrl"
    ]
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attrs["FifoQueue"] == "true" and attrs["ContentBasedDeduplication"] == "true", attrs
    try:
        sqs.send_message(QueueUrl=url, MessageBody="no group")
        raise AssertionError("a FIFO message without MessageGroupId was taken")
    except sqs.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "MissingParameter", e.response
    seqs = []
    for i in range(3):
        for g in ("a", "b"):
            r = sqs.send_message(QueueUrl=url, MessageBody=f"{g}{i}", MessageGroupId=g)
            seqs.append(int(r["SequenceNumber"]))
    assert seqs == sorted(seqs) and len(set(seqs)) == 6, seqs
    # The same body again within five minutes: accepted, not delivered (content-based deduplication).
    sqs.send_message(QueueUrl=url, MessageBody="a0", MessageGroupId="a")
    explicit = sqs.send_message_batch(
        QueueUrl=url,
        Entries=[
            {"Id": "1", "MessageBody": "c0", "MessageGroupId": "c", "MessageDeduplicationId": "same"},
            {"Id": "2", "MessageBody": "c1", "MessageGroupId": "c", "MessageDeduplicationId": "same"},
        ],
    )
    assert len(explicit["Successful"]) == 2 and not explicit["Failed"], explicit
    done = {"a": [], "b": [], "c": []}
    deadline = time.monotonic() + 10
    while sum(map(len, done.values())) < 7:
        assert time.monotonic() < deadline, done
        got = sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, MessageSystemAttributeNames=["All"], WaitTimeSeconds=1
        ).get("Messages", [])
        groups = [m["Attributes"]["MessageGroupId"] for m in got]
        # Never two of one group in flight at once: the next waits for the delete.
        assert len(groups) == len(set(groups)), groups
        for m in got:
            g = m["Attributes"]["MessageGroupId"]
            assert m["Attributes"]["SequenceNumber"].isdigit(), m
            assert m["Attributes"]["MessageDeduplicationId"], m
            done[g].append(m["Body"])
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    assert done == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0"]}, done
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1), "a duplicate was delivered"
    try:
        sqs.send_message(QueueUrl=url, MessageBody="late", MessageGroupId="a", DelaySeconds=5)
        raise AssertionError("a per-message delay on a FIFO queue was taken")
    except sqs.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "InvalidParameterValue", e.response
    sqs.delete_queue(QueueUrl=url)


def main():
    for f in FLOWS:
        try:
            f()
        except Exception as e:  # noqa: BLE001 - reported to the Rust test
            traceback.print_exc()
            print(f"FAIL: {f.__name__}: {e!r}", flush=True)
            sys.exit(1)
        print(f"ok - {f.__name__}", flush=True)


if __name__ == "__main__":
    main()
