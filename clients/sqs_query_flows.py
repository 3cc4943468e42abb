#!/usr/bin/env python3
"""SQS's query protocol (form-encoded requests, XML answers), as SDKs from before the JSON protocol send it:
botocore 1.31, unchanged, against Warren's SQS endpoint.
Usage: python3 sqs_query_flows.py http://127.0.0.1:9324

Prints one "ok - <flow>" line per flow; exits non-zero with "FAIL: <flow>: <reason>" on the first failure.
"""

import hashlib
import sys
import time
import traceback
import uuid

try:
    import botocore
    import botocore.session
except ImportError as e:  # pragma: no cover - reported to the Rust test
    print(f"FAIL: import: {e} (scripts/test installs botocore 1.31 into clients/.deps/python-legacy)", file=sys.stderr)
    sys.exit(2)

ENDPOINT = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:9324"


def client():
    session = botocore.session.get_session()
    c = session.create_client(
        "sqs",
        endpoint_url=ENDPOINT,
        region_name="us-east-1",
        aws_access_key_id="guest",
        aws_secret_access_key="guest",
    )
    assert c.meta.service_model.protocol == "query", c.meta.service_model.protocol
    return c


def unique(prefix):
    return f"{prefix}-query-{uuid.uuid4().hex[:12]}"


FLOWS = []


def flow(f):
    FLOWS.append(f)
    return f


@flow
def queues_and_their_attributes():
    sqs = client()
    name = unique("jobs")
    url = sqs.create_queue(QueueName=name, Attributes={"VisibilityTimeout": "45", "DelaySeconds": "0"})["QueueUrl"]
    assert url.endswith("/000000000000/" + name), url
    assert sqs.get_queue_url(QueueName=name)["QueueUrl"] == url
    listed = sqs.list_queues(QueueNamePrefix=name)["QueueUrls"]
    assert listed == [url], listed
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attrs["VisibilityTimeout"] == "45" and attrs["ApproximateNumberOfMessages"] == "0", attrs
    assert attrs["QueueArn"].endswith(":" + name), attrs
    sqs.set_queue_attributes(QueueUrl=url, Attributes={"VisibilityTimeout": "5", "DelaySeconds": "2"})
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attrs["VisibilityTimeout"] == "5" and attrs["DelaySeconds"] == "2", attrs
    sqs.tag_queue(QueueUrl=url, Tags={"team": "billing", "env": "staging"})
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"team": "billing", "env": "staging"}
    sqs.untag_queue(QueueUrl=url, TagKeys=["env"])
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"team": "billing"}
    sqs.delete_queue(QueueUrl=url)
    try:
        sqs.get_queue_url(QueueName=name)
        raise AssertionError("a deleted queue was found")
    except sqs.exceptions.QueueDoesNotExist:
        pass
    assert "QueueUrls" not in sqs.list_queues(QueueNamePrefix=name)


@flow
def messages_with_attributes_batches_and_visibility():
    sqs = client()
    url = sqs.create_queue(QueueName=unique("msgs"))["QueueUrl"]
    body = "line one\r\nline <two> & 'three'"
    attrs = {
        "kind": {"DataType": "String", "StringValue": "report"},
        "tries": {"DataType": "Number", "StringValue": "3"},
        "blob": {"DataType": "Binary", "BinaryValue": b"\x00\x01\xff"},
    }
    # botocore checks MD5OfMessageBody and MD5OfMessageAttributes against its own.
    sent = sqs.send_message(QueueUrl=url, MessageBody=body, MessageAttributes=attrs)
    assert sent["MD5OfMessageBody"] == hashlib.md5(body.encode()).hexdigest(), sent
    got = sqs.receive_message(
        QueueUrl=url, AttributeNames=["All"], MessageAttributeNames=["All"], MaxNumberOfMessages=10, WaitTimeSeconds=1
    )["Messages"]
    assert len(got) == 1, got
    m = got[0]
    assert m["Body"] == body and m["MessageId"] == sent["MessageId"], m
    assert m["MessageAttributes"]["blob"]["BinaryValue"] == b"\x00\x01\xff", m
    assert m["MessageAttributes"]["tries"] == {"DataType": "Number", "StringValue": "3"}, m
    assert m["Attributes"]["ApproximateReceiveCount"] == "1", m
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
    again = sqs.receive_message(QueueUrl=url, AttributeNames=["ApproximateReceiveCount"], WaitTimeSeconds=1)
    assert again["Messages"][0]["Attributes"]["ApproximateReceiveCount"] == "2", again
    sqs.delete_message(QueueUrl=url, ReceiptHandle=again["Messages"][0]["ReceiptHandle"])

    batch = sqs.send_message_batch(
        QueueUrl=url,
        Entries=[{"Id": f"e{i}", "MessageBody": f"job {i}"} for i in range(12 - 2)],
    )
    assert len(batch["Successful"]) == 10 and not batch.get("Failed"), batch
    bad = sqs.send_message_batch(
        QueueUrl=url, Entries=[{"Id": "ok", "MessageBody": "fine"}, {"Id": "bad", "MessageBody": "\x01"}]
    )
    assert [e["Id"] for e in bad["Successful"]] == ["ok"], bad
    assert bad["Failed"][0]["Id"] == "bad" and bad["Failed"][0]["SenderFault"] is True, bad
    seen = []
    while len(seen) < 11:
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
        assert got, f"only {len(seen)} received"
        done = sqs.delete_message_batch(
            QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)]
        )
        assert len(done["Successful"]) == len(got), done
        seen += [m["Body"] for m in got]
    assert sorted(seen) == sorted([f"job {i}" for i in range(10)] + ["fine"]), seen
    sqs.purge_queue(QueueUrl=url)
    sqs.delete_queue(QueueUrl=url)


@flow
def errors_have_the_query_protocols_codes():
    sqs = client()
    try:
        sqs.send_message(QueueUrl=ENDPOINT + "/000000000000/" + unique("missing"), MessageBody="x")
        raise AssertionError("sent to a missing queue")
    except sqs.exceptions.QueueDoesNotExist as e:
        assert e.response["Error"]["Code"] == "AWS.SimpleQueueService.NonExistentQueue", e.response
    url = sqs.create_queue(QueueName=unique("errs"))["QueueUrl"]
    try:
        sqs.create_queue(QueueName=url.rsplit("/", 1)[1], Attributes={"VisibilityTimeout": "99"})
        raise AssertionError("created twice with another value")
    except botocore.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "QueueAlreadyExists", e.response
    sqs.delete_queue(QueueUrl=url)


@flow
def dead_letter_sources():
    sqs = client()
    dlq = sqs.create_queue(QueueName=unique("dlq"))["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = '{"deadLetterTargetArn": "%s", "maxReceiveCount": "2"}' % arn
    sources = sorted(
        sqs.create_queue(QueueName=unique(f"src{i}"), Attributes={"RedrivePolicy": policy})["QueueUrl"] for i in range(2)
    )
    assert sorted(sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"]) == sources
    # A move task over the query protocol (an empty DLQ: it completes at once).
    handle = sqs.start_message_move_task(SourceArn=arn, DestinationArn=arn.rsplit(":", 1)[0] + ":" + sources[0].rsplit("/", 1)[1])["TaskHandle"]
    assert handle, handle
    for _ in range(200):
        tasks = sqs.list_message_move_tasks(SourceArn=arn, MaxResults=10)["Results"]
        if tasks[0]["Status"] != "RUNNING":
            break
        time.sleep(0.025)
    assert tasks[0]["Status"] == "COMPLETED" and tasks[0]["ApproximateNumberOfMessagesMoved"] == 0, tasks
    for u in sources + [dlq]:
        sqs.delete_queue(QueueUrl=u)


@flow
def fifo_queue():
    sqs = client()
    url = sqs.create_queue(QueueName=unique("orders") + ".fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    for i in range(3):
        r = sqs.send_message(QueueUrl=url, MessageBody=f"o{i}", MessageGroupId="g", MessageDeduplicationId=f"d{i}")
        assert r["SequenceNumber"].isdigit(), r
    bodies = []
    for _ in range(3):
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, AttributeNames=["All"], WaitTimeSeconds=1)
        (m,) = got["Messages"]
        assert m["Attributes"]["MessageGroupId"] == "g", m
        bodies.append(m["Body"])
        sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    assert bodies == ["o0", "o1", "o2"], bodies
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
