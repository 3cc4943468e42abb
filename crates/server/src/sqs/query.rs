//! SQS's older query protocol: a form-encoded `Action=...&Version=2012-11-05&...` request
//! (in the body of a POST, or the query string of a GET), answered in XML. Older SDKs send
//! it (boto3 before the JSON protocol, the Java SDK v1, older PHP and Ruby SDKs). A request is
//! turned into the JSON protocol's input and served by the same actions; their JSON answer is
//! written out in the query protocol's XML.
//!
//! Lists and maps arrive flattened: `AttributeName.1=All`, `Attribute.1.Name=...` with
//! `Attribute.1.Value=...`, `MessageAttribute.1.Value.StringValue=...`,
//! `SendMessageBatchRequestEntry.2.MessageBody=...`.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::SqsError;

/// The namespace of SQS's XML.
const XMLNS: &str = "http://queue.amazonaws.com/doc/2012-11-05/";

/// The most parameters a request may have (a batch of 10 messages with 10 attributes each,
/// three fields an attribute, is about 350), and the most dots in a parameter's name (the
/// deepest SQS has: `SendMessageBatchRequestEntry.N.MessageAttribute.M.Value.StringValue`).
/// Past them a request is refused before anything is built from it.
const MAX_PARAMETERS: usize = 2_000;
const MAX_DEPTH: usize = 6;
/// The largest list number taken (SQS's lists are at most 10 long; attribute names fewer
/// than 100).
const MAX_INDEX: u64 = 1_000;

/// A flattened parameter's tree: a value, or members by name (list items by their number).
#[derive(Debug)]
enum Node {
    Leaf(String),
    Members(BTreeMap<String, Node>),
}

/// Does this request use the query protocol? A form body, or a GET with an `Action`.
pub fn is_query(content_type: Option<&str>, query: Option<&str>) -> bool {
    content_type.is_some_and(|c| c.starts_with("application/x-www-form-urlencoded"))
        || query.is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(k, _)| k == "Action"))
}

/// The action and its input, as the JSON protocol would carry them. `queue_url`: the URL the
/// request was sent to, for a request that names its queue that way (older SDKs post to the
/// queue's URL).
pub fn input(
    form: &[u8],
    queue_url: Option<String>,
) -> Result<(String, Map<String, Value>), SqsError> {
    let mut root: BTreeMap<String, Node> = BTreeMap::new();
    let mut action = None;
    if form_urlencoded::parse(form).count() > MAX_PARAMETERS {
        return Err(SqsError::invalid_parameter(format!(
            "A request has at most {MAX_PARAMETERS} parameters."
        )));
    }
    for (k, v) in form_urlencoded::parse(form) {
        match k.as_ref() {
            "Action" => action = Some(v.into_owned()),
            "Version" => {}
            _ => insert(&mut root, &k, v.into_owned())?,
        }
    }
    let Some(action) = action else {
        return Err(SqsError::missing_parameter("Action"));
    };
    let mut input = convert(root);
    if let Some(url) = queue_url {
        input.entry("QueueUrl").or_insert(Value::String(url));
    }
    Ok((action, input))
}

fn insert(root: &mut BTreeMap<String, Node>, key: &str, value: String) -> Result<(), SqsError> {
    let bad = |why: &str| {
        // The name is not echoed: it may hold anything.
        SqsError::invalid_parameter(format!("A parameter's name is not one SQS takes ({why})."))
    };
    if key.split('.').count() > MAX_DEPTH {
        return Err(bad("too many parts"));
    }
    for part in key.split('.') {
        if part.is_empty() {
            return Err(bad("an empty part"));
        }
        let number = |p: &str| {
            p.parse::<u64>()
                .is_ok_and(|n| (1..=MAX_INDEX).contains(&n) && n.to_string() == p)
        };
        if part.bytes().all(|b| b.is_ascii_digit()) && !number(part) {
            return Err(bad("a list number out of range"));
        }
    }
    let mut parts = key.split('.').peekable();
    let mut at = root;
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            if matches!(at.get(part), Some(Node::Members(_))) {
                return Err(bad("given both as a value and as a list"));
            }
            at.insert(part.to_owned(), Node::Leaf(value));
            return Ok(());
        }
        let node = at
            .entry(part.to_owned())
            .or_insert_with(|| Node::Members(BTreeMap::new()));
        at = match node {
            Node::Members(m) => m,
            Node::Leaf(_) => return Err(bad("given both as a value and as a list")),
        };
    }
    Ok(())
}

/// The members of a flattened list, in their numbers' order (`Entry.2` after `Entry.1`, and
/// `Entry.10` after both).
fn items(members: BTreeMap<String, Node>) -> Vec<Node> {
    let mut v: Vec<(u64, Node)> = members
        .into_iter()
        .filter_map(|(k, n)| Some((k.parse().ok()?, n)))
        .collect();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, n)| n).collect()
}

fn leaf(n: Node) -> Option<String> {
    match n {
        Node::Leaf(s) => Some(s),
        Node::Members(_) => None,
    }
}

fn fields(n: Node) -> BTreeMap<String, Node> {
    match n {
        Node::Members(m) => m,
        Node::Leaf(_) => BTreeMap::new(),
    }
}

/// `Name.N.<key>` / `Name.N.<value>` pairs as one map.
fn pairs(members: BTreeMap<String, Node>, key: &str, value: &str) -> Map<String, Value> {
    let mut out = Map::new();
    for item in items(members) {
        let mut f = fields(item);
        let k = f.remove(key).and_then(leaf);
        let v = f.remove(value);
        if let (Some(k), Some(v)) = (k, v) {
            let v = match v {
                Node::Leaf(s) => Value::String(s),
                Node::Members(m) => Value::Object(convert(m)),
            };
            out.insert(k, v);
        }
    }
    out
}

/// A flattened request's members, under the JSON protocol's names.
fn convert(members: BTreeMap<String, Node>) -> Map<String, Value> {
    let mut out = Map::new();
    for (k, node) in members {
        let (name, value) = match (k.as_str(), node) {
            (_, Node::Leaf(s)) => (k, Value::String(s)),
            ("Attribute", Node::Members(m)) => (
                "Attributes".into(),
                Value::Object(pairs(m, "Name", "Value")),
            ),
            ("MessageAttribute", Node::Members(m)) => (
                "MessageAttributes".into(),
                Value::Object(pairs(m, "Name", "Value")),
            ),
            ("Tag", Node::Members(m)) => ("tags".into(), Value::Object(pairs(m, "Key", "Value"))),
            (
                "AttributeName" | "MessageAttributeName" | "MessageSystemAttributeName" | "TagKey",
                Node::Members(m),
            ) => {
                let list: Vec<Value> = items(m)
                    .into_iter()
                    .filter_map(leaf)
                    .map(Value::String)
                    .collect();
                (format!("{k}s"), Value::Array(list))
            }
            (
                "SendMessageBatchRequestEntry"
                | "DeleteMessageBatchRequestEntry"
                | "ChangeMessageVisibilityBatchRequestEntry",
                Node::Members(m),
            ) => {
                let list: Vec<Value> = items(m)
                    .into_iter()
                    .map(|n| Value::Object(convert(fields(n))))
                    .collect();
                ("Entries".into(), Value::Array(list))
            }
            (_, Node::Members(m)) => (k, Value::Object(convert(m))),
        };
        out.insert(name, value);
    }
    out
}

/// Is `c` a character XML 1.0 can carry (even as a reference)?
fn xml_char(c: char) -> bool {
    !((c < ' ' && !matches!(c, '\t' | '\n' | '\r')) || c == '\u{FFFE}' || c == '\u{FFFF}')
}

/// A received body XML cannot carry (an AMQP publisher's control characters) is given with
/// the replacement character there, and its digest is of what is given: a parser would refuse
/// the whole answer otherwise.
fn xml_bodies(answer: &Map<String, Value>) -> Option<Map<String, Value>> {
    let messages = answer.get("Messages")?.as_array()?;
    let bad = |m: &Value| {
        m.get("Body")
            .and_then(Value::as_str)
            .is_some_and(|b| !b.chars().all(xml_char))
    };
    if !messages.iter().any(bad) {
        return None;
    }
    let mut fixed = answer.clone();
    if let Some(Value::Array(list)) = fixed.get_mut("Messages") {
        for m in list.iter_mut() {
            let Some(Value::String(body)) = m.get("Body") else {
                continue;
            };
            let clean: String = body
                .chars()
                .map(|c| if xml_char(c) { c } else { '\u{FFFD}' })
                .collect();
            if let Value::Object(o) = m {
                o.insert(
                    "MD5OfBody".into(),
                    Value::String(super::attributes::md5_hex(clean.as_bytes())),
                );
                o.insert("Body".into(), Value::String(clean));
            }
        }
    }
    Some(fixed)
}

/// The XML answer to `action` from the JSON protocol's answer.
pub fn output(action: &str, answer: &Map<String, Value>, request_id: &str) -> String {
    let fixed = xml_bodies(answer);
    let answer = fixed.as_ref().unwrap_or(answer);
    let mut x = String::with_capacity(256);
    x.push_str(&format!(
        "<?xml version=\"1.0\"?><{action}Response xmlns=\"{XMLNS}\">"
    ));
    if !answer.is_empty() || action_has_result(action) {
        x.push_str(&format!("<{action}Result>"));
        for (k, v) in answer {
            member(&mut x, action, k, v);
        }
        x.push_str(&format!("</{action}Result>"));
    }
    x.push_str(&format!(
        "<ResponseMetadata><RequestId>{request_id}</RequestId></ResponseMetadata></{action}Response>"
    ));
    x
}

/// Actions whose answer has a result element even when it is empty (no messages, no queues).
fn action_has_result(action: &str) -> bool {
    matches!(
        action,
        "ReceiveMessage"
            | "ListQueues"
            | "GetQueueAttributes"
            | "ListQueueTags"
            | "ListDeadLetterSourceQueues"
            | "ListMessageMoveTasks"
    )
}

/// One member of a result, as the query protocol lays it out.
fn member(x: &mut String, action: &str, key: &str, v: &Value) {
    match (key, v) {
        ("Attributes", Value::Object(m)) => {
            for (name, value) in m {
                x.push_str("<Attribute><Name>");
                escape(x, name);
                x.push_str("</Name><Value>");
                escape(x, &text(value));
                x.push_str("</Value></Attribute>");
            }
        }
        ("MessageAttributes", Value::Object(m)) => {
            for (name, value) in m {
                x.push_str("<MessageAttribute><Name>");
                escape(x, name);
                x.push_str("</Name><Value>");
                if let Value::Object(fields) = value {
                    for (f, fv) in fields {
                        element(x, f, &text(fv));
                    }
                }
                x.push_str("</Value></MessageAttribute>");
            }
        }
        ("Tags", Value::Object(m)) => {
            for (k, value) in m {
                x.push_str("<Tag><Key>");
                escape(x, k);
                x.push_str("</Key><Value>");
                escape(x, &text(value));
                x.push_str("</Value></Tag>");
            }
        }
        (_, Value::Array(list)) => {
            let item = item_name(action, key);
            for v in list {
                match v {
                    Value::Object(m) => {
                        x.push_str(&format!("<{item}>"));
                        for (k, v) in m {
                            member(x, action, k, v);
                        }
                        x.push_str(&format!("</{item}>"));
                    }
                    other => element(x, item, &text(other)),
                }
            }
        }
        (_, Value::Object(m)) => {
            x.push_str(&format!("<{key}>"));
            for (k, v) in m {
                member(x, action, k, v);
            }
            x.push_str(&format!("</{key}>"));
        }
        (_, v) => element(x, key, &text(v)),
    }
}

/// The element each item of a JSON list is in.
fn item_name<'a>(action: &str, key: &'a str) -> &'a str {
    match (action, key) {
        (_, "QueueUrls") => "QueueUrl",
        (_, "queueUrls") => "QueueUrl",
        (_, "Messages") => "Message",
        (_, "Failed") => "BatchResultErrorEntry",
        ("SendMessageBatch", "Successful") => "SendMessageBatchResultEntry",
        ("DeleteMessageBatch", "Successful") => "DeleteMessageBatchResultEntry",
        ("ChangeMessageVisibilityBatch", "Successful") => "ChangeMessageVisibilityBatchResultEntry",
        ("ListMessageMoveTasks", "Results") => "ListMessageMoveTasksResultEntry",
        (_, other) => other.strip_suffix('s').unwrap_or(other),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn element(x: &mut String, name: &str, value: &str) {
    x.push('<');
    x.push_str(name);
    x.push('>');
    escape(x, value);
    x.push_str("</");
    x.push_str(name);
    x.push('>');
}

/// XML text, with what a parser would change written as references (a carriage return would
/// otherwise come back as a line feed).
fn escape(x: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '&' => x.push_str("&amp;"),
            '<' => x.push_str("&lt;"),
            '>' => x.push_str("&gt;"),
            '"' => x.push_str("&quot;"),
            '\'' => x.push_str("&apos;"),
            '\r' => x.push_str("&#xD;"),
            c if !xml_char(c) => x.push('\u{FFFD}'),
            c => x.push(c),
        }
    }
}

/// An error as the query protocol sends it.
pub fn error(e: &SqsError, request_id: &str) -> String {
    let mut x = String::with_capacity(256);
    x.push_str("<?xml version=\"1.0\"?><ErrorResponse xmlns=\"");
    x.push_str(XMLNS);
    x.push_str("\"><Error>");
    element(&mut x, "Type", if e.sender { "Sender" } else { "Receiver" });
    element(&mut x, "Code", e.code);
    element(&mut x, "Message", &e.message);
    x.push_str("<Detail/></Error>");
    element(&mut x, "RequestId", request_id);
    x.push_str("</ErrorResponse>");
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattened_parameters_become_the_json_input() {
        let form = "Action=SendMessageBatch&Version=2012-11-05\
            &SendMessageBatchRequestEntry.2.Id=b&SendMessageBatchRequestEntry.2.MessageBody=two\
            &SendMessageBatchRequestEntry.10.Id=c&SendMessageBatchRequestEntry.10.MessageBody=ten\
            &SendMessageBatchRequestEntry.1.Id=a&SendMessageBatchRequestEntry.1.MessageBody=one%20%26\
            &SendMessageBatchRequestEntry.1.MessageAttribute.1.Name=kind\
            &SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.DataType=String\
            &SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.StringValue=report";
        let (action, got) =
            input(form.as_bytes(), Some("http://h/000000000000/q".into())).expect("parsed");
        assert_eq!(action, "SendMessageBatch");
        assert_eq!(got["QueueUrl"], "http://h/000000000000/q");
        let entries = got["Entries"].as_array().expect("entries");
        let ids: Vec<&str> = entries
            .iter()
            .map(|e| e["Id"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(ids, ["a", "b", "c"], "in their numbers' order");
        assert_eq!(entries[0]["MessageBody"], "one &");
        assert_eq!(
            entries[0]["MessageAttributes"]["kind"],
            serde_json::json!({"DataType": "String", "StringValue": "report"})
        );
        let form = "Action=CreateQueue&QueueName=q&Attribute.1.Name=VisibilityTimeout\
            &Attribute.1.Value=60&Attribute.2.Name=DelaySeconds&Attribute.2.Value=5";
        let (_, got) = super::input(form.as_bytes(), None).expect("parsed");
        assert_eq!(
            got["Attributes"],
            serde_json::json!({"VisibilityTimeout": "60", "DelaySeconds": "5"})
        );
        assert!(got.get("QueueUrl").is_none());
        let (_, got) = super::input(
            b"Action=ReceiveMessage&AttributeName.1=All&MessageAttributeName.1=kind",
            None,
        )
        .expect("parsed");
        assert_eq!(got["AttributeNames"], serde_json::json!(["All"]));
        assert_eq!(got["MessageAttributeNames"], serde_json::json!(["kind"]));
        assert!(super::input(b"QueueName=q", None).is_err(), "no action");
        assert!(
            input(b"Action=X&A=1&A.1=2", None).is_err(),
            "a value and a list"
        );
        assert!(
            input(b"Action=X&A.1=2&A=1", None).is_err(),
            "a list and a value"
        );
    }

    #[test]
    fn hostile_forms_are_refused_before_anything_is_built() {
        let deep = format!("Action=X&{}=1", vec!["a"; 100_000].join("."));
        assert!(input(deep.as_bytes(), None).is_err(), "a deep name");
        assert!(
            input(b"Action=X&a.b.c.d.e.f=1", None).is_ok(),
            "SQS's deepest"
        );
        assert!(input(b"Action=X&a.b.c.d.e.f.g=1", None).is_err());
        let many: String = (0..3_000).map(|i| format!("&P{i}=1")).collect();
        assert!(input(format!("Action=X{many}").as_bytes(), None).is_err());
        for bad in [
            "Action=X&E.0.Id=a",
            "Action=X&E.01.Id=a",
            "Action=X&E.1001.Id=a",
            "Action=X&E..Id=a",
        ] {
            assert!(input(bad.as_bytes(), None).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_are_written_as_the_query_protocol_lays_them_out() {
        let answer = serde_json::json!({
            "Messages": [{
                "MessageId": "m-1",
                "Body": "a<b>&\r\n",
                "Attributes": {"ApproximateReceiveCount": "1"},
                "MessageAttributes": {"kind": {"DataType": "String", "StringValue": "x"}}
            }]
        });
        let Value::Object(answer) = answer else {
            unreachable!()
        };
        let x = output("ReceiveMessage", &answer, "r-1");
        assert!(
            x.starts_with("<?xml version=\"1.0\"?><ReceiveMessageResponse xmlns="),
            "{x}"
        );
        assert!(x.contains("<ReceiveMessageResult><Message><Attribute><Name>ApproximateReceiveCount</Name><Value>1</Value></Attribute><Body>a&lt;b&gt;&amp;&#xD;\n</Body>"), "{x}");
        assert!(x.contains("<MessageAttribute><Name>kind</Name><Value><DataType>String</DataType><StringValue>x</StringValue></Value></MessageAttribute>"), "{x}");
        assert!(x.ends_with("<ResponseMetadata><RequestId>r-1</RequestId></ResponseMetadata></ReceiveMessageResponse>"), "{x}");
        let empty = output("ReceiveMessage", &Map::new(), "r-2");
        assert!(
            empty.contains("<ReceiveMessageResult></ReceiveMessageResult>"),
            "{empty}"
        );
        let deleted = output("DeleteQueue", &Map::new(), "r-3");
        assert!(!deleted.contains("Result"), "{deleted}");
        let batch = serde_json::json!({
            "Successful": [{"Id": "a", "MessageId": "m"}],
            "Failed": [{"Id": "b", "SenderFault": true, "Code": "X", "Message": "no"}]
        });
        let Value::Object(batch) = batch else {
            unreachable!()
        };
        let x = output("SendMessageBatch", &batch, "r-4");
        assert!(x.contains("<BatchResultErrorEntry><Code>X</Code><Id>b</Id><Message>no</Message><SenderFault>true</SenderFault></BatchResultErrorEntry>"), "{x}");
        assert!(x.contains("<SendMessageBatchResultEntry><Id>a</Id><MessageId>m</MessageId></SendMessageBatchResultEntry>"), "{x}");
        // A control character an AMQP publisher put in a body: replaced, digest of the result.
        let raw = serde_json::json!({"Messages": [{"Body": "a\u{1}b", "MD5OfBody": "x"}]});
        let Value::Object(raw) = raw else {
            unreachable!()
        };
        let x = output("ReceiveMessage", &raw, "r-6");
        let md5 = super::super::attributes::md5_hex("a\u{FFFD}b".as_bytes());
        assert!(
            x.contains("<Body>a\u{FFFD}b</Body>") && x.contains(&md5),
            "{x}"
        );
        let e = error(&SqsError::no_queue(), "r-5");
        assert!(
            e.contains(
                "<Error><Type>Sender</Type><Code>AWS.SimpleQueueService.NonExistentQueue</Code>"
            ),
            "{e}"
        );
    }
}
