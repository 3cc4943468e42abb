//! The SQS API (AWS's JSON 1.0 protocol) on a real broker, with plain HTTP requests signed
//! here (Signature Version 4): credentials and AWS's error codes, the queue actions, send,
//! receive with long polling, visibility, delete, redrive to a dead-letter queue, durability
//! across a restart, and the same queues seen over AMQP (lapin).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use warren_conformance::{unique, TestBroker};

/// The SQS API is Warren's own: against an external broker (`WARREN_TEST_URL`, RabbitMQ)
/// there is nothing to test.
fn skipped(b: &TestBroker) -> bool {
    if b.is_external() {
        eprintln!("skipped: the SQS API is Warren's, not the external broker's");
    }
    b.is_external()
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Reply {
    fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }

    /// The error's shape (`__type` after the `#`).
    fn error(&self) -> &str {
        self.body["__type"]
            .as_str()
            .and_then(|t| t.rsplit('#').next())
            .unwrap_or("")
    }

    fn ok(self) -> Value {
        assert_eq!(
            self.status, 200,
            "SQS answered {}: {}",
            self.status, self.body
        );
        self.body
    }
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).unwrap();
    m.update(data.as_bytes());
    m.finalize().into_bytes().to_vec()
}

fn amz_date(unix: u64) -> String {
    // Civil date from days (Howard Hinnant's algorithm), to stay free of a date crate.
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

struct Client {
    /// `127.0.0.1:PORT`
    host: String,
    key: String,
    secret: String,
    /// Seconds added to the clock (clock skew tests).
    skew: i64,
    sign: bool,
}

impl Client {
    fn new(b: &TestBroker) -> Client {
        let url = b.sqs_url().expect("SQS on");
        Client {
            host: url.trim_start_matches("http://").to_owned(),
            key: "guest".into(),
            secret: "guest".into(),
            skew: 0,
            sign: true,
        }
    }

    /// The request date, and the `Authorization` header's value for a POST to `/` with these
    /// canonical headers (`name:value` lines, sorted), their names, and this body.
    fn authorization(
        &self,
        headers: &dyn Fn(&str) -> String,
        signed: &str,
        body: &str,
    ) -> (String, String) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let date = amz_date((now + self.skew) as u64);
        let canonical = format!(
            "POST\n/\n\n{}\n\n{signed}\n{}",
            headers(&date),
            hex::encode(Sha256::digest(body.as_bytes()))
        );
        let scope = format!("{}/us-east-1/sqs/aws4_request", &date[..8]);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{date}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let k = hmac(format!("AWS4{}", self.secret).as_bytes(), &date[..8]);
        let k = hmac(&k, "us-east-1");
        let k = hmac(&k, "sqs");
        let k = hmac(&k, "aws4_request");
        let sig = hex::encode(hmac(&k, &to_sign));
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={sig}",
            self.key
        );
        (date, auth)
    }

    fn call(&self, action: &str, body: Value) -> Reply {
        let body = body.to_string();
        let target = format!("AmazonSQS.{action}");
        let ctype = "application/x-amz-json-1.0";
        let (date, auth) = self.authorization(
            &|date| {
                format!(
                    "content-type:{ctype}\nhost:{}\nx-amz-date:{date}\nx-amz-target:{target}",
                    self.host
                )
            },
            "content-type;host;x-amz-date;x-amz-target",
            &body,
        );
        let mut req = format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Type: {ctype}\r\nX-Amz-Date: {date}\r\nX-Amz-Target: {target}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.host,
            body.len()
        );
        if self.sign {
            req.push_str(&format!("Authorization: {auth}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(&body);
        let mut s = TcpStream::connect(&self.host).expect("connect to the SQS port");
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("headers");
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .unwrap()
            .parse()
            .unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_owned()))
            .collect();
        let body = serde_json::from_slice(&raw[end + 4..]).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
        }
    }

    /// A query-protocol call (a signed form POST to `/`): its status and XML answer.
    fn call_query(&self, form: &str) -> (u16, String) {
        let ctype = "application/x-www-form-urlencoded";
        let (date, auth) = self.authorization(
            &|date| {
                format!(
                    "content-type:{ctype}\nhost:{}\nx-amz-date:{date}",
                    self.host
                )
            },
            "content-type;host;x-amz-date",
            form,
        );
        let req = format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Type: {ctype}\r\nX-Amz-Date: {date}\r\nContent-Length: {}\r\nConnection: close\r\nAuthorization: {auth}\r\n\r\n{form}",
            self.host,
            form.len(),
        );
        let mut s = TcpStream::connect(&self.host).expect("connect to the SQS port");
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    fn create(&self, name: &str, attrs: Value) -> String {
        self.call(
            "CreateQueue",
            json!({"QueueName": name, "Attributes": attrs}),
        )
        .ok()["QueueUrl"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    fn send(&self, url: &str, body: &str) -> Value {
        self.call("SendMessage", json!({"QueueUrl": url, "MessageBody": body}))
            .ok()
    }

    fn receive(&self, url: &str, extra: Value) -> Vec<Value> {
        let mut req = json!({"QueueUrl": url});
        if let (Some(r), Some(e)) = (req.as_object_mut(), extra.as_object()) {
            r.extend(e.clone());
        }
        self.call("ReceiveMessage", req).ok()["Messages"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    fn count(&self, url: &str, attr: &str) -> u64 {
        self.call(
            "GetQueueAttributes",
            json!({"QueueUrl": url, "AttributeNames": [attr]}),
        )
        .ok()["Attributes"][attr]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    }
}

#[test]
fn credentials_are_checked_with_aws_error_codes() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    assert_eq!(c.call("ListQueues", json!({})).status, 200);

    let mut wrong = Client::new(&b);
    wrong.secret = "not-guest".into();
    let r = wrong.call("ListQueues", json!({}));
    assert_eq!((r.status, r.error()), (403, "SignatureDoesNotMatch"));

    let mut unknown = Client::new(&b);
    unknown.key = "nobody".into();
    let r = unknown.call("ListQueues", json!({}));
    assert_eq!((r.status, r.error()), (403, "InvalidClientTokenId"));

    let mut unsigned = Client::new(&b);
    unsigned.sign = false;
    let r = unsigned.call("ListQueues", json!({}));
    assert_eq!((r.status, r.error()), (403, "MissingAuthenticationToken"));

    let mut late = Client::new(&b);
    late.skew = -20 * 60;
    let r = late.call("ListQueues", json!({}));
    assert_eq!((r.status, r.error()), (400, "RequestExpired"));
    late.skew = -5 * 60;
    assert_eq!(late.call("ListQueues", json!({})).status, 200);
}

/// A configured user other than guest signs with its password, and is held to its vhost
/// permissions as over AMQP: here write only (send), no configure (create) and no read
/// (receive).
#[test]
fn a_configured_user_signs_with_its_password_and_has_its_permissions() {
    let dir = std::env::temp_dir().join(unique("warren-sqs-users"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("users.toml");
    std::fs::write(
        &file,
        "[[users]]\nname = \"guest\"\npassword = \"guest\"\nloopback_only = true\ntags = [\"administrator\"]\n\
         [[users]]\nname = \"writer\"\npassword = \"s3cret\"\n",
    )
    .unwrap();
    let b = TestBroker::start_with(&["--config", file.to_str().unwrap()]);
    if skipped(&b) {
        return;
    }
    let api = b.http_url().expect("management API on").to_owned();
    let r = warren_conformance::http::request(
        "PUT",
        &format!("{api}/api/permissions/%2F/writer"),
        Some(("guest", "guest")),
        &[],
        Some(r#"{"configure": "^$", "write": ".*", "read": "^$"}"#),
    );
    assert!(r.status < 300, "set permissions: {}", r.status);
    let guest = Client::new(&b);
    let url = guest.create(&unique("sqs-perm"), json!({}));
    let mut writer = Client::new(&b);
    writer.key = "writer".into();
    writer.secret = "s3cret".into();
    writer.send(&url, "allowed");
    let r = writer.call("ReceiveMessage", json!({"QueueUrl": url}));
    assert_eq!((r.status, r.error()), (403, "AccessDeniedException"));
    let r = writer.call("CreateQueue", json!({"QueueName": unique("sqs-no")}));
    assert_eq!((r.status, r.error()), (403, "AccessDeniedException"));
    writer.secret = "guest".into();
    assert_eq!(
        writer.call("ListQueues", json!({})).error(),
        "SignatureDoesNotMatch"
    );
    assert_eq!(guest.receive(&url, json!({})).len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A user made through the management API (whose password Warren keeps only as a hash)
/// signs with an access key: made by the API, listed without its secret, held to the user's
/// permissions, refused once deleted, and gone with its user. The key survives a restart.
#[test]
fn a_user_made_through_the_api_signs_with_an_access_key() {
    let mut b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let api = warren_conformance::http::Api::of(&b);
    api.put(
        "/users/worker",
        json!({"password": "pw-worker", "tags": ""}),
    );
    api.put(
        "/permissions/%2F/worker",
        json!({"configure": "^$", "write": ".*", "read": ".*"}),
    );
    let mut by_password = Client::new(&b);
    by_password.key = "worker".into();
    by_password.secret = "pw-worker".into();
    let r = by_password.call("ListQueues", json!({}));
    assert_eq!(
        (r.status, r.error()),
        (403, "InvalidClientTokenId"),
        "the server knows only the password's hash"
    );
    let (status, made) = api.call("POST", "/users/worker/access-keys", None);
    assert_eq!(status, 201, "{made}");
    let id = made["access_key_id"].as_str().expect("an id").to_owned();
    let secret = made["secret_access_key"]
        .as_str()
        .expect("a secret")
        .to_owned();
    assert!(id.starts_with("WKIA") && id.len() == 20, "{id}");
    assert_eq!(secret.len(), 40);
    let (_, listed) = api.call("GET", "/users/worker/access-keys", None);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["access_key_id"], id.as_str());
    assert!(
        !listed.to_string().contains(&secret),
        "a list never shows the secret"
    );
    let (status, _) = api.call("POST", "/users/nobody/access-keys", None);
    assert_eq!(status, 404);

    let guest = Client::new(&b);
    let url = guest.create(&unique("sqs-key"), json!({}));
    let mut worker = Client::new(&b);
    worker.key = id.clone();
    worker.secret = secret.clone();
    worker.send(&url, "from the worker's key");
    assert_eq!(worker.receive(&url, json!({})).len(), 1);
    let r = worker.call("CreateQueue", json!({"QueueName": unique("sqs-no")}));
    assert_eq!(
        (r.status, r.error()),
        (403, "AccessDeniedException"),
        "the key acts as its user, with the user's permissions"
    );

    // The key was on disk before the API answered: it still works after a kill -9.
    b.restart(true);
    let api = warren_conformance::http::Api::of(&b);
    let mut worker = Client::new(&b);
    worker.key = id.clone();
    worker.secret = secret.clone();
    assert_eq!(
        worker.call("ListQueues", json!({})).status,
        200,
        "after a restart"
    );

    let (status, _) = api.call("DELETE", &format!("/users/guest/access-keys/{id}"), None);
    assert_eq!(status, 404, "only its own user's path deletes it");
    let (status, _) = api.call("DELETE", &format!("/users/worker/access-keys/{id}"), None);
    assert_eq!(status, 204);
    let r = worker.call("ListQueues", json!({}));
    assert_eq!((r.status, r.error()), (403, "InvalidClientTokenId"));

    // A user's keys go with the user.
    let (_, second) = api.call("POST", "/users/worker/access-keys", None);
    let second = second["access_key_id"].as_str().expect("an id").to_owned();
    let (status, _) = api.call("DELETE", "/users/worker", None);
    assert_eq!(status, 204);
    let (_, all) = api.call("GET", "/access-keys", None);
    assert!(
        !all.to_string().contains(&second),
        "a deleted user's keys are gone: {all}"
    );
}

/// On a cluster, SendMessage to a quorum queue answers once a majority has the message, as an
/// AMQP confirm does: on a leader cut off from the others it is refused (500, after the API's
/// wait), never answered 200 from the leader's disk alone.
#[test]
fn an_sqs_send_to_a_quorum_queue_is_answered_once_a_majority_has_it() {
    use warren_conformance::cluster::TestCluster;
    let c = TestCluster::start_partitionable(
        3,
        20,
        &["--test-api-write-wait-ms", "1500", TestCluster::WITH_SQS],
    );
    if skipped(c.node(1)) {
        return;
    }
    let q = unique("sqs-qq");
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(c.declare_quorum_queue(1, &q));
    let leader = c.leader_of(&q, 1);
    let sqs = Client::new(c.node(leader));
    let url = format!("http://{}/000000000000/{q}", sqs.host);
    // A leader just elected refuses until its term's first entry applies (503, which SDKs
    // retry): retried as they would.
    let start = Instant::now();
    loop {
        let r = sqs.call(
            "SendMessage",
            json!({"QueueUrl": url, "MessageBody": "with a majority"}),
        );
        if r.status != 503 || start.elapsed() > Duration::from_secs(10) {
            r.ok();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    c.cut(leader);
    let r = sqs.call(
        "SendMessage",
        json!({"QueueUrl": url, "MessageBody": "alone"}),
    );
    assert_ne!(
        r.status,
        200,
        "answered without a majority: {:?}",
        r.error()
    );
    c.heal(leader);
}

#[test]
fn queues_are_created_listed_found_and_deleted() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let name = unique("sqs-q");
    let url = c.create(&name, json!({"VisibilityTimeout": "45"}));
    assert_eq!(url, format!("http://{}/000000000000/{name}", c.host));
    // Again with the same attribute, or none: the same queue.
    assert_eq!(c.create(&name, json!({"VisibilityTimeout": "45"})), url);
    assert_eq!(c.create(&name, json!({})), url);
    let r = c.call(
        "CreateQueue",
        json!({"QueueName": name, "Attributes": {"VisibilityTimeout": "46"}}),
    );
    assert_eq!((r.status, r.error()), (400, "QueueNameExists"));
    assert_eq!(
        r.header("x-amzn-query-error"),
        Some("QueueAlreadyExists;Sender")
    );

    let got = c.call("GetQueueUrl", json!({"QueueName": name})).ok();
    assert_eq!(got["QueueUrl"], url.as_str());
    let attrs = c
        .call(
            "GetQueueAttributes",
            json!({"QueueUrl": url, "AttributeNames": ["All"]}),
        )
        .ok();
    assert_eq!(attrs["Attributes"]["VisibilityTimeout"], "45");
    assert_eq!(attrs["Attributes"]["MessageRetentionPeriod"], "345600");
    assert_eq!(
        attrs["Attributes"]["QueueArn"],
        format!("arn:aws:sqs:us-east-1:000000000000:{name}").as_str()
    );

    // Pages of ListQueues.
    let prefix = unique("sqs-page");
    for i in 0..3 {
        c.create(&format!("{prefix}-{i}"), json!({}));
    }
    let first = c
        .call(
            "ListQueues",
            json!({"QueueNamePrefix": prefix, "MaxResults": 2}),
        )
        .ok();
    assert_eq!(first["QueueUrls"].as_array().unwrap().len(), 2);
    let token = first["NextToken"].as_str().expect("a next page").to_owned();
    let second = c
        .call(
            "ListQueues",
            json!({"QueueNamePrefix": prefix, "MaxResults": 2, "NextToken": token}),
        )
        .ok();
    assert_eq!(second["QueueUrls"].as_array().unwrap().len(), 1);
    assert!(second.get("NextToken").is_none());

    c.call("DeleteQueue", json!({"QueueUrl": url})).ok();
    let r = c.call("GetQueueUrl", json!({"QueueName": name}));
    assert_eq!((r.status, r.error()), (400, "QueueDoesNotExist"));
    assert_eq!(
        r.header("x-amzn-query-error"),
        Some("AWS.SimpleQueueService.NonExistentQueue;Sender")
    );
    let r = c.call("SendMessage", json!({"QueueUrl": url, "MessageBody": "x"}));
    assert_eq!(r.error(), "QueueDoesNotExist");
}

#[test]
fn send_receive_delete_with_attributes_and_digests() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let url = c.create(&unique("sqs-m"), json!({}));
    let sent = c
        .call(
            "SendMessage",
            json!({"QueueUrl": url, "MessageBody": "hello",
                   "MessageAttributes": {"a": {"DataType": "String", "StringValue": "b"}}}),
        )
        .ok();
    assert_eq!(sent["MD5OfMessageBody"], "5d41402abc4b2a76b9719d911017c592");
    // The digest of {"a": String "b"}, by AWS's algorithm (computed apart).
    assert_eq!(sent["MD5OfMessageAttributes"], ATTR_MD5);
    let got = c.receive(
        &url,
        json!({"MessageAttributeNames": ["All"], "MessageSystemAttributeNames": ["All"]}),
    );
    assert_eq!(got.len(), 1);
    let m = &got[0];
    assert_eq!(m["Body"], "hello");
    assert_eq!(m["MessageId"], sent["MessageId"]);
    assert_eq!(m["MD5OfBody"], "5d41402abc4b2a76b9719d911017c592");
    assert_eq!(m["MD5OfMessageAttributes"], ATTR_MD5);
    assert_eq!(m["MessageAttributes"]["a"]["StringValue"], "b");
    assert_eq!(m["Attributes"]["ApproximateReceiveCount"], "1");
    assert!(m["Attributes"]["SentTimestamp"].as_str().is_some());
    assert!(m["Attributes"]["ApproximateFirstReceiveTimestamp"]
        .as_str()
        .is_some());
    assert_eq!(c.count(&url, "ApproximateNumberOfMessagesNotVisible"), 1);
    // Invisible to the next receive.
    assert!(c.receive(&url, json!({})).is_empty());
    c.call(
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": m["ReceiptHandle"]}),
    )
    .ok();
    assert_eq!(c.count(&url, "ApproximateNumberOfMessagesNotVisible"), 0);
    assert_eq!(c.count(&url, "ApproximateNumberOfMessages"), 0);

    let r = c.call(
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": "garbage"}),
    );
    assert_eq!((r.status, r.error()), (400, "ReceiptHandleIsInvalid"));
    let big = "x".repeat(262_145);
    let r = c.call("SendMessage", json!({"QueueUrl": url, "MessageBody": big}));
    assert_eq!(
        (r.status, r.header("x-amzn-query-error")),
        (400, Some("InvalidParameterValue;Sender"))
    );
}

const ATTR_MD5: &str = "bef8bf215374a0a228d67533b1a488be";

#[test]
fn batches_and_visibility_changes() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let url = c.create(&unique("sqs-b"), json!({}));
    let r = c
        .call(
            "SendMessageBatch",
            json!({"QueueUrl": url, "Entries": [
                {"Id": "a", "MessageBody": "1"},
                {"Id": "b", "MessageBody": "2"},
                {"Id": "c", "MessageBody": ""},
            ]}),
        )
        .ok();
    assert_eq!(r["Successful"].as_array().unwrap().len(), 2);
    assert_eq!(r["Failed"][0]["Id"], "c");
    let r = c.call(
        "SendMessageBatch",
        json!({"QueueUrl": url, "Entries": [{"Id": "a", "MessageBody": "1"}, {"Id": "a", "MessageBody": "2"}]}),
    );
    assert_eq!(r.error(), "BatchEntryIdsNotDistinct");
    let got = c.receive(&url, json!({"MaxNumberOfMessages": 10}));
    assert_eq!(got.len(), 2);
    // One back at once, one given more time.
    let r = c
        .call(
            "ChangeMessageVisibilityBatch",
            json!({"QueueUrl": url, "Entries": [
                {"Id": "x", "ReceiptHandle": got[0]["ReceiptHandle"], "VisibilityTimeout": 0},
                {"Id": "y", "ReceiptHandle": got[1]["ReceiptHandle"], "VisibilityTimeout": 600},
            ]}),
        )
        .ok();
    assert_eq!(r["Successful"].as_array().unwrap().len(), 2);
    let again = c.receive(
        &url,
        json!({"MaxNumberOfMessages": 10, "AttributeNames": ["ApproximateReceiveCount"]}),
    );
    assert_eq!(again.len(), 1);
    assert_eq!(again[0]["Body"], got[0]["Body"]);
    assert_eq!(again[0]["Attributes"]["ApproximateReceiveCount"], "2");
    // The first delivery's handle is stale now: deleting with it leaves the message.
    c.call(
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": got[0]["ReceiptHandle"]}),
    )
    .ok();
    assert_eq!(c.count(&url, "ApproximateNumberOfMessagesNotVisible"), 2);
    let r = c.call(
        "ChangeMessageVisibility",
        json!({"QueueUrl": url, "ReceiptHandle": got[0]["ReceiptHandle"], "VisibilityTimeout": 5}),
    );
    assert_eq!(r.error(), "MessageNotInflight");
    let r = c
        .call(
            "DeleteMessageBatch",
            json!({"QueueUrl": url, "Entries": [
                {"Id": "p", "ReceiptHandle": again[0]["ReceiptHandle"]},
                {"Id": "q", "ReceiptHandle": got[1]["ReceiptHandle"]},
            ]}),
        )
        .ok();
    assert_eq!(r["Successful"].as_array().unwrap().len(), 2);
    assert_eq!(c.count(&url, "ApproximateNumberOfMessagesNotVisible"), 0);
}

#[test]
fn a_visibility_timeout_returns_an_undeleted_message() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let url = c.create(&unique("sqs-v"), json!({"VisibilityTimeout": "1"}));
    c.send(&url, "job");
    // Received, then the client goes away without deleting it.
    assert_eq!(c.receive(&url, json!({})).len(), 1);
    assert!(c.receive(&url, json!({})).is_empty());
    let back = c.receive(
        &url,
        json!({"WaitTimeSeconds": 5, "AttributeNames": ["All"]}),
    );
    assert_eq!(
        back.len(),
        1,
        "the message came back after its visibility timeout"
    );
    assert_eq!(back[0]["Attributes"]["ApproximateReceiveCount"], "2");
}

#[test]
fn a_long_poll_answers_when_a_message_arrives() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let url = c.create(&unique("sqs-lp"), json!({}));
    // Empty: waits the whole time, and answers with no message.
    let t = Instant::now();
    assert!(c.receive(&url, json!({"WaitTimeSeconds": 1})).is_empty());
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );

    let poller = {
        let c = Client::new(&b);
        let url = url.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let got = c.receive(&url, json!({"WaitTimeSeconds": 10}));
            (got, t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    c.send(&url, "wake up");
    let (got, waited) = poller.join().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["Body"], "wake up");
    // Answered at the send, far from the 10 s of the poll (loosely: the machine is shared).
    assert!(waited < Duration::from_secs(5), "the poll took {waited:?}");
    assert!(sent.elapsed() < Duration::from_secs(4));
}

#[test]
fn a_message_goes_to_the_dead_letter_queue_after_max_receive_count() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let dlq = c.create(&unique("sqs-dlq"), json!({}));
    let arn = c
        .call(
            "GetQueueAttributes",
            json!({"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}),
        )
        .ok()["Attributes"]["QueueArn"]
        .as_str()
        .unwrap()
        .to_owned();
    let policy = json!({"deadLetterTargetArn": arn, "maxReceiveCount": "2"}).to_string();
    let url = c.create(&unique("sqs-src"), json!({"RedrivePolicy": policy}));
    let attrs = c
        .call(
            "GetQueueAttributes",
            json!({"QueueUrl": url, "AttributeNames": ["RedrivePolicy"]}),
        )
        .ok();
    let back: Value =
        serde_json::from_str(attrs["Attributes"]["RedrivePolicy"].as_str().unwrap()).unwrap();
    assert_eq!(back["maxReceiveCount"], 2);
    c.send(&url, "poison");
    for n in 1..=2 {
        let got = c.receive(
            &url,
            json!({"VisibilityTimeout": 0, "AttributeNames": ["All"]}),
        );
        assert_eq!(got.len(), 1, "receive {n}");
        assert_eq!(
            got[0]["Attributes"]["ApproximateReceiveCount"],
            n.to_string()
        );
    }
    assert!(c.receive(&url, json!({})).is_empty());
    let dead = c.receive(&dlq, json!({}));
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["Body"], "poison");
}

#[test]
fn delays_hold_messages_back() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    // A message's own delay on a queue without one.
    let url = c.create(&unique("sqs-d"), json!({}));
    c.call(
        "SendMessage",
        json!({"QueueUrl": url, "MessageBody": "later", "DelaySeconds": 1}),
    )
    .ok();
    assert!(c.receive(&url, json!({})).is_empty());
    let got = c.receive(&url, json!({"WaitTimeSeconds": 5}));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["Body"], "later");
    // The queue's own delay.
    let url = c.create(&unique("sqs-dq"), json!({"DelaySeconds": "1"}));
    c.send(&url, "held");
    assert!(c.receive(&url, json!({})).is_empty());
    assert_eq!(c.receive(&url, json!({"WaitTimeSeconds": 5})).len(), 1);
}

#[test]
fn a_sent_message_survives_a_restart() {
    let mut b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let name = unique("sqs-durable");
    let url = c.create(&name, json!({}));
    c.send(&url, "kept");
    // Received and not deleted when the broker dies: back after the restart.
    assert_eq!(c.receive(&url, json!({})).len(), 1);
    b.restart(true);
    let c = Client::new(&b);
    let url = c.call("GetQueueUrl", json!({"QueueName": name})).ok()["QueueUrl"]
        .as_str()
        .unwrap()
        .to_owned();
    let got = c.receive(&url, json!({"WaitTimeSeconds": 5}));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["Body"], "kept");
}

#[tokio::test]
async fn amqp_and_sqs_clients_share_a_queue() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let name = unique("sqs-amqp");
    let url = c.create(&name, json!({}));
    let conn = b.connect().await;
    let ch = conn.create_channel().await.unwrap();
    // Confirmed before the receive: a plain publish may still be on its way when the SQS
    // request, on another connection, reaches the queue.
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // AMQP in, SQS out: headers are message attributes.
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("kind"),
        AMQPValue::LongString("report".into()),
    );
    headers.insert(ShortString::from("tries"), AMQPValue::LongInt(3));
    ch.basic_publish(
        "".into(),
        name.as_str().into(),
        BasicPublishOptions::default(),
        b"from amqp",
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let got = c.receive(&url, json!({"MessageAttributeNames": ["All"]}));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["Body"], "from amqp");
    assert_eq!(got[0]["MessageAttributes"]["kind"]["StringValue"], "report");
    assert_eq!(got[0]["MessageAttributes"]["tries"]["DataType"], "Number");
    assert_eq!(got[0]["MessageAttributes"]["tries"]["StringValue"], "3");
    c.call(
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": got[0]["ReceiptHandle"]}),
    )
    .ok();
    // SQS in, AMQP out: attributes are headers.
    c.call(
        "SendMessage",
        json!({"QueueUrl": url, "MessageBody": "from sqs",
               "MessageAttributes": {"kind": {"DataType": "String", "StringValue": "invoice"}}}),
    )
    .ok();
    let m = ch
        .basic_get(name.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(m.delivery.data, b"from sqs");
    let h = m.delivery.properties.headers().clone().unwrap();
    assert_eq!(
        h.inner().get("kind"),
        Some(&AMQPValue::LongString("invoice".into()))
    );
}

/// CPU seconds the process has used (Linux).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// A long poll on a queue whose ready message it cannot take (behind its group's message in
/// flight) sleeps: it is woken only when the queue gains a message it could take.
#[tokio::test]
async fn a_long_poll_that_cannot_take_a_message_does_not_spin() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let name = unique("sqs-grp");
    let conn = b.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-group-header"),
        AMQPValue::LongString("g".into()),
    );
    ch.queue_declare(
        name.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    for body in [b"first", b"later"] {
        let mut h = FieldTable::default();
        h.insert(ShortString::from("g"), AMQPValue::LongString("a".into()));
        ch.basic_publish(
            "".into(),
            name.as_str().into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(h),
        )
        .await
        .unwrap();
    }
    let c = Client::new(&b);
    let url = c.call("GetQueueUrl", json!({"QueueName": name})).ok()["QueueUrl"]
        .as_str()
        .unwrap()
        .to_owned();
    let pid = b.pid().expect("a spawned broker");
    let poll = tokio::task::spawn_blocking(move || {
        assert_eq!(c.receive(&url, json!({"WaitTimeSeconds": 5})).len(), 1);
        let before = cpu_seconds(pid);
        let got = c.receive(&url, json!({"WaitTimeSeconds": 2}));
        (got.len(), cpu_seconds(pid) - before)
    });
    let (got, cpu) = poll.await.unwrap();
    assert_eq!(got, 0, "the group's next message waits for the first");
    // A poll woken by its own look spins a core for the whole wait.
    assert!(
        cpu < 0.5,
        "the broker used {cpu:.2} s of CPU during a 2 s poll"
    );
}

#[test]
fn set_queue_attributes_and_tags_change_a_live_queue_and_survive_a_restart() {
    let mut b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let name = unique("sqs-live");
    let url = c.create(&name, json!({}));
    let attrs = |c: &Client, url: &str| -> Value {
        c.call(
            "GetQueueAttributes",
            json!({"QueueUrl": url, "AttributeNames": ["All"]}),
        )
        .ok()["Attributes"]
            .clone()
    };
    c.send(&url, "queued before");
    // A redrive policy set on a queue that holds a message: the message's receives count.
    let dlq = c.create(&unique("sqs-live-dlq"), json!({}));
    let dlq_arn = attrs(&c, &dlq)["QueueArn"].as_str().unwrap().to_owned();
    let redrive = json!({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 1}).to_string();
    c.call(
        "SetQueueAttributes",
        json!({"QueueUrl": url, "Attributes": {"VisibilityTimeout": "0", "RedrivePolicy": redrive}}),
    )
    .ok();
    let now = attrs(&c, &url);
    assert_eq!(now["VisibilityTimeout"], "0");
    assert_eq!(now["MessageRetentionPeriod"], "345600", "untouched");
    let got = c.receive(&url, json!({}));
    assert_eq!(got.len(), 1, "the queued message stays");
    // Received once with a visibility of 0: the next receive moves it to the DLQ.
    assert!(c.receive(&url, json!({})).is_empty());
    let dead = c.receive(&dlq, json!({"WaitTimeSeconds": 2}));
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["Body"], "queued before");
    // Removing the redrive policy; refusals leave the queue as it was.
    c.call(
        "SetQueueAttributes",
        json!({"QueueUrl": url, "Attributes": {"RedrivePolicy": "", "DelaySeconds": "1"}}),
    )
    .ok();
    assert!(attrs(&c, &url).get("RedrivePolicy").is_none());
    for (attrs_given, code) in [
        (
            json!({"VisibilityTimeout": "43201"}),
            "InvalidAttributeValue",
        ),
        (json!({"FifoQueue": "true"}), "InvalidAttributeValue"),
        (
            json!({"ContentBasedDeduplication": "true"}),
            "InvalidAttributeName",
        ),
        (json!({"Colour": "blue"}), "InvalidAttributeName"),
        (
            json!({"RedrivePolicy": json!({"deadLetterTargetArn":
                "arn:aws:sqs:us-east-1:000000000000:no-such-queue", "maxReceiveCount": 2}).to_string()}),
            "InvalidParameterValueException",
        ),
    ] {
        let r = c.call(
            "SetQueueAttributes",
            json!({"QueueUrl": url, "Attributes": attrs_given}),
        );
        assert_eq!((r.status, r.error()), (400, code), "{attrs_given}");
    }
    assert_eq!(attrs(&c, &url)["VisibilityTimeout"], "0");

    // Tags: at creation, added, changed, removed.
    let tagged_name = unique("sqs-tags");
    let tagged = c
        .call(
            "CreateQueue",
            json!({"QueueName": tagged_name, "tags": {"team": "billing"}}),
        )
        .ok()["QueueUrl"]
        .as_str()
        .unwrap()
        .to_owned();
    let tags = |c: &Client, url: &str| c.call("ListQueueTags", json!({"QueueUrl": url})).ok();
    assert_eq!(tags(&c, &tagged)["Tags"], json!({"team": "billing"}));
    c.call(
        "TagQueue",
        json!({"QueueUrl": tagged, "Tags": {"team": "payments", "env": "staging"}}),
    )
    .ok();
    assert_eq!(
        tags(&c, &tagged)["Tags"],
        json!({"team": "payments", "env": "staging"})
    );
    c.call(
        "UntagQueue",
        json!({"QueueUrl": tagged, "TagKeys": ["env", "absent"]}),
    )
    .ok();
    assert_eq!(tags(&c, &tagged)["Tags"], json!({"team": "payments"}));
    let many: serde_json::Map<String, Value> =
        (0..51).map(|i| (format!("k{i}"), json!("v"))).collect();
    let r = c.call("TagQueue", json!({"QueueUrl": tagged, "Tags": many}));
    assert_eq!(
        (r.status, r.error()),
        (400, "InvalidParameterValueException")
    );

    b.restart(true);
    let c = Client::new(&b);
    let url_of = |c: &Client, name: &str| {
        c.call("GetQueueUrl", json!({"QueueName": name})).ok()["QueueUrl"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (url, tagged) = (url_of(&c, &name), url_of(&c, &tagged_name));
    let after = attrs(&c, &url);
    assert_eq!(after["VisibilityTimeout"], "0", "kept across the restart");
    assert_eq!(after["DelaySeconds"], "1");
    assert_eq!(tags(&c, &tagged)["Tags"], json!({"team": "payments"}));
    let untagged = c.call("ListQueueTags", json!({"QueueUrl": url})).ok();
    assert!(untagged.get("Tags").is_none(), "{untagged}");
}

#[test]
fn message_move_tasks_redrive_a_dead_letter_queue_and_lose_nothing() {
    let b = TestBroker::start();
    if skipped(&b) {
        return;
    }
    let c = Client::new(&b);
    let arn_of = |c: &Client, url: &str| -> String {
        c.call(
            "GetQueueAttributes",
            json!({"QueueUrl": url, "AttributeNames": ["QueueArn"]}),
        )
        .ok()["Attributes"]["QueueArn"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let dlq = c.create(&unique("sqs-move-dlq"), json!({}));
    let dlq_arn = arn_of(&c, &dlq);
    let redrive = json!({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 1}).to_string();
    let a = c.create(
        &unique("sqs-move-a"),
        json!({"RedrivePolicy": redrive, "VisibilityTimeout": "0"}),
    );
    let b_url = c.create(
        &unique("sqs-move-b"),
        json!({"RedrivePolicy": redrive, "VisibilityTimeout": "0"}),
    );
    for i in 0..3 {
        c.send(&a, &format!("a-{i}"));
    }
    for i in 0..2 {
        c.send(&b_url, &format!("b-{i}"));
    }
    // Received once each (visible again at once), then dead-lettered on the next receive.
    let drained = |c: &Client, url: &str| {
        for _ in 0..20 {
            if c.receive(url, json!({"MaxNumberOfMessages": 10}))
                .is_empty()
            {
                return;
            }
        }
        panic!("{url} did not drain");
    };
    drained(&c, &a);
    drained(&c, &b_url);
    assert_eq!(c.count(&dlq, "ApproximateNumberOfMessages"), 5);

    let r = c.call("StartMessageMoveTask", json!({"SourceArn": arn_of(&c, &a)}));
    assert_eq!((r.status, r.error()), (400, "UnsupportedOperation"));
    let r = c.call(
        "StartMessageMoveTask",
        json!({"SourceArn": dlq_arn, "MaxNumberOfMessagesPerSecond": 501}),
    );
    assert_eq!(
        (r.status, r.error()),
        (400, "InvalidParameterValueException")
    );
    let r = c.call(
        "StartMessageMoveTask",
        json!({"SourceArn": "arn:aws:sqs:us-east-1:000000000000:no-such-queue"}),
    );
    assert_eq!((r.status, r.error()), (400, "ResourceNotFoundException"));

    let latest = |c: &Client| -> Value {
        c.call("ListMessageMoveTasks", json!({"SourceArn": dlq_arn}))
            .ok()["Results"][0]
            .clone()
    };
    let finished = |c: &Client| -> Value {
        for _ in 0..200 {
            let t = latest(c);
            if !matches!(t["Status"].as_str(), Some("RUNNING" | "CANCELLING")) {
                return t;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("the task did not end: {}", latest(c));
    };
    // Back to where each came from.
    let handle = c
        .call("StartMessageMoveTask", json!({"SourceArn": dlq_arn}))
        .ok()["TaskHandle"]
        .as_str()
        .unwrap()
        .to_owned();
    let done = finished(&c);
    assert_eq!(done["Status"], "COMPLETED", "{done}");
    assert_eq!(done["ApproximateNumberOfMessagesMoved"], 5);
    assert_eq!(done["ApproximateNumberOfMessagesToMove"], 5);
    assert!(
        done.get("TaskHandle").is_none(),
        "only a running task shows its handle"
    );
    let bodies = |c: &Client, url: &str| -> BTreeSet<String> {
        let mut got = BTreeSet::new();
        for _ in 0..5 {
            for m in c.receive(
                url,
                json!({"MaxNumberOfMessages": 10, "VisibilityTimeout": 30}),
            ) {
                got.insert(m["Body"].as_str().unwrap().to_owned());
                c.call(
                    "DeleteMessage",
                    json!({"QueueUrl": url, "ReceiptHandle": m["ReceiptHandle"]}),
                )
                .ok();
            }
        }
        got
    };
    assert_eq!(
        bodies(&c, &a),
        ["a-0", "a-1", "a-2"].map(String::from).into()
    );
    assert_eq!(bodies(&c, &b_url), ["b-0", "b-1"].map(String::from).into());
    let r = c.call("CancelMessageMoveTask", json!({"TaskHandle": handle}));
    assert_eq!((r.status, r.error()), (400, "UnsupportedOperation"));

    // A message sent to the DLQ itself has no queue to go back to: the task fails and the
    // message stays; with a destination it moves.
    c.send(&dlq, "stray");
    c.call("StartMessageMoveTask", json!({"SourceArn": dlq_arn}))
        .ok();
    let failed = finished(&c);
    assert_eq!(failed["Status"], "FAILED", "{failed}");
    assert!(failed["FailureReason"]
        .as_str()
        .is_some_and(|r| !r.is_empty()));
    assert_eq!(c.count(&dlq, "ApproximateNumberOfMessages"), 1);
    let b_arn = arn_of(&c, &b_url);
    c.call(
        "StartMessageMoveTask",
        json!({"SourceArn": dlq_arn, "DestinationArn": b_arn}),
    )
    .ok();
    let moved = finished(&c);
    assert_eq!(moved["Status"], "COMPLETED", "{moved}");
    assert_eq!(moved["DestinationArn"], b_arn.as_str());
    assert_eq!(bodies(&c, &b_url), ["stray"].map(String::from).into());

    // A slow task cancelled: what it moved is moved, the rest stays in the DLQ.
    for i in 0..40 {
        c.send(&dlq, &format!("slow-{i}"));
    }
    let handle = c
        .call(
            "StartMessageMoveTask",
            json!({"SourceArn": dlq_arn, "DestinationArn": b_arn, "MaxNumberOfMessagesPerSecond": 20}),
        )
        .ok()["TaskHandle"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = c.call("StartMessageMoveTask", json!({"SourceArn": dlq_arn}));
    assert_eq!(
        (r.status, r.error()),
        (400, "UnsupportedOperation"),
        "one task at a time"
    );
    std::thread::sleep(Duration::from_millis(300));
    c.call("CancelMessageMoveTask", json!({"TaskHandle": handle}))
        .ok();
    let cancelled = finished(&c);
    assert_eq!(cancelled["Status"], "CANCELLED", "{cancelled}");
    let n = cancelled["ApproximateNumberOfMessagesMoved"]
        .as_u64()
        .unwrap();
    assert!(n < 40, "{n} moved before the cancel");
    let listed = c
        .call(
            "ListMessageMoveTasks",
            json!({"SourceArn": dlq_arn, "MaxResults": 10}),
        )
        .ok();
    assert_eq!(listed["Results"].as_array().map(Vec::len), Some(4));
    let in_b = bodies(&c, &b_url);
    let mut in_dlq = BTreeSet::new();
    for _ in 0..10 {
        in_dlq.extend(bodies(&c, &dlq));
    }
    assert_eq!(in_b.len() + in_dlq.len(), 40, "nothing lost by the cancel");
    assert!(in_b.is_disjoint(&in_dlq));
    let r = c.call(
        "CancelMessageMoveTask",
        json!({"TaskHandle": "no-such-task"}),
    );
    assert_eq!((r.status, r.error()), (400, "ResourceNotFoundException"));
}

/// On a cluster, the calls that take or settle a quorum queue's messages (ReceiveMessage,
/// DeleteMessage, ChangeMessageVisibility and their batches) work through any node: a node
/// that does not lead the queue sends them on to the leader's SQS endpoint, signature and
/// all. Before, they failed there with an InternalError ("not led by this node"), and a
/// receive on the leader right after a send could come back with fewer messages than ready.
#[test]
fn a_quorum_queues_messages_are_received_and_deleted_through_any_node() {
    use warren_conformance::cluster::TestCluster;
    use warren_conformance::http::Api;
    let c = TestCluster::start_with(3, 20, &[TestCluster::WITH_SQS]);
    if skipped(c.node(1)) {
        return;
    }
    let q = unique("sqs-qq-any");
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(c.declare_quorum_queue(1, &q));
    let leader = c.leader_of(&q, 1);
    let follower = if leader == 1 { 2 } else { 1 };
    // The follower learns where the leader's SQS endpoint listens from the figures nodes
    // share.
    c.wait_for_endpoint(follower, leader, "sqs");
    let sqs = Client::new(c.node(follower));
    let url = format!("http://{}/000000000000/{q}", sqs.host);
    for i in 0..4 {
        sqs.call(
            "SendMessage",
            json!({"QueueUrl": url, "MessageBody": format!("m{i}")}),
        )
        .ok();
    }
    let got = sqs
        .call(
            "ReceiveMessage",
            json!({"QueueUrl": url, "MaxNumberOfMessages": 10, "VisibilityTimeout": 60}),
        )
        .ok();
    let messages = got["Messages"].as_array().cloned().unwrap_or_default();
    let bodies: Vec<&str> = messages.iter().filter_map(|m| m["Body"].as_str()).collect();
    assert_eq!(bodies, ["m0", "m1", "m2", "m3"], "{got}");
    // The queue URL the answer's handles go with is the one the client used.
    let handle = |i: usize| messages[i]["ReceiptHandle"].clone();
    sqs.call(
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": handle(0)}),
    )
    .ok();
    let r = sqs
        .call(
            "DeleteMessageBatch",
            json!({"QueueUrl": url, "Entries": [{"Id": "a", "ReceiptHandle": handle(1)}]}),
        )
        .ok();
    assert_eq!(r["Successful"].as_array().map(Vec::len), Some(1), "{r}");
    // Visible again at once, through the leader itself this time: a handle names no node.
    let direct = Client::new(c.node(leader));
    direct
        .call(
            "ChangeMessageVisibility",
            json!({"QueueUrl": url, "ReceiptHandle": handle(2), "VisibilityTimeout": 0}),
        )
        .ok();
    let again = sqs
        .call(
            "ReceiveMessage",
            json!({"QueueUrl": url, "MaxNumberOfMessages": 10}),
        )
        .ok();
    let bodies: Vec<&str> = again["Messages"]
        .as_array()
        .map(|l| l.iter().filter_map(|m| m["Body"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(bodies, ["m2"], "{again}");
    // The query protocol too (older SDKs): a form with the queue's URL.
    sqs.call(
        "SendMessage",
        json!({"QueueUrl": url, "MessageBody": "by-form"}),
    )
    .ok();
    let form = format!(
        "Action=ReceiveMessage&Version=2012-11-05&QueueUrl={}&VisibilityTimeout=60",
        url.replace(':', "%3A").replace('/', "%2F")
    );
    let (status, xml) = sqs.call_query(&form);
    assert_eq!(status, 200, "{xml}");
    assert!(xml.contains("<Body>by-form</Body>"), "{xml}");
    // Three messages left, all in flight, on every node.
    for n in 1..=3 {
        let api = Api::of(c.node(n));
        let start = Instant::now();
        loop {
            let (_, v) = api.call("GET", &format!("/queues/%2f/{q}"), None);
            if v["messages"] == 3 && v["messages_unacknowledged"] == 3 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(15), "node {n}: {v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
