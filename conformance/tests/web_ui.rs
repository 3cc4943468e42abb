//! The web page served at `/` of the management port (`crates/server/src/http/ui/index.html`), in a real
//! browser: headless Chromium loads each view with `--dump-dom` and the test reads what it shows.
//!
//! The page takes credentials from its URL fragment for this (`#/queues?user=guest&pass=guest`: stored in
//! sessionStorage, then removed from the address bar), and `?peek=N` on a queue's page runs "Get messages" (a
//! requeueing peek) on load, so no clicks are needed. Each element read here has a `data-testid`, or a
//! `data-queue` / `data-connection` (table rows) and `data-col` (cells).
//!
//! Needs Chromium (`chromium`, `chromium-browser`, `google-chrome` on the PATH, or `WARREN_CHROMIUM`). Without it
//! the test says so and passes, unless `WARREN_TEST_REQUIRE_CHROMIUM=1` (scripts/test sets it once it installed
//! Chromium). Skipped against an external broker (`WARREN_TEST_URL`).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use warren_conformance::{within, TestBroker};

/// How long one page load may take in the browser, start to DOM dump.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(45);
/// Page time (virtual: it stands still while requests are in flight) before the DOM is dumped.
const VIRTUAL_TIME_MS: u32 = 3000;

const ORDERS: &str = "ui-orders";
const WORK: &str = "ui-work";
const EMPTY: &str = "ui-empty";
/// A queue name that is markup: the page must show it as text.
const EVIL: &str = "ui <b>bold</b> & \"quoted\" <img src=x>";

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WARREN_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// Loads `url` in headless Chromium and returns the DOM it dumped after the page's scripts ran.
fn dump_dom(chromium: &Path, url: &str) -> String {
    let profile = std::env::temp_dir().join(format!(
        "warren-ui-chromium-{}-{}",
        std::process::id(),
        warren_conformance::unique("p")
    ));
    let mut child = Command::new(chromium)
        .args([
            "--headless=new",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--virtual-time-budget={VIRTUAL_TIME_MS}"))
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut out);
            }
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let stdout = reader(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = reader(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + BROWSER_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for chromium") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&profile);
            panic!(
                "chromium did not finish loading {url} within {BROWSER_TIMEOUT:?}; stderr:\n{}",
                stderr.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let dom = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        status.success() && dom.contains("</html>"),
        "chromium failed on {url} ({status}); stderr:\n{err}"
    );
    dom
}

async fn load(chromium: &Path, url: String) -> String {
    let chromium = chromium.to_path_buf();
    tokio::task::spawn_blocking(move || dump_dom(&chromium, &url))
        .await
        .expect("the browser thread panicked")
}

/// Loads a view as a logged-in user: it must have rendered its data (`data-loaded` on the view) and
/// show no error.
async fn view(chromium: &Path, url: String) -> String {
    let dom = load(chromium, url.clone()).await;
    let view = open_tag(&dom, "data-testid", "view")
        .unwrap_or_else(|| panic!("no view in the page at {url}:\n{dom}"));
    assert!(
        view.contains("data-loaded=\"1\""),
        "the view at {url} did not finish loading:\n{dom}"
    );
    let error = open_tag(&dom, "data-testid", "error").expect("the error banner");
    assert!(
        error.contains(" hidden"),
        "the view at {url} shows an error: {:?}",
        text_by(&dom, "data-testid", "error")
    );
    dom
}

/// `&amp;` and friends back to text.
fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// The text of the first element whose `attr` is `value`, tags inside it dropped (the element
/// must not hold another element of its own kind).
fn text_by(dom: &str, attr: &str, value: &str) -> Option<String> {
    let start = element_start(dom, attr, value)?;
    let rest = &dom[start..];
    let tag: String = rest[1..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let open_end = rest.find('>')? + 1;
    let inner = &rest[open_end..open_end + rest[open_end..].find(&format!("</{tag}>"))?];
    let mut text = String::new();
    let mut in_tag = false;
    for c in inner.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    Some(unescape(&text).trim().to_owned())
}

/// The opening tag of the first element whose `attr` is `value`.
fn open_tag<'a>(dom: &'a str, attr: &str, value: &str) -> Option<&'a str> {
    let start = element_start(dom, attr, value)?;
    Some(&dom[start..start + dom[start..].find('>')?])
}

/// Where the tag holding `attr="value"` starts (values compared unescaped).
fn element_start(dom: &str, attr: &str, value: &str) -> Option<usize> {
    let needle = format!(" {attr}=\"");
    let mut from = 0;
    while let Some(i) = dom[from..].find(&needle) {
        let v_start = from + i + needle.len();
        let v_end = v_start + dom[v_start..].find('"')?;
        if unescape(&dom[v_start..v_end]) == value {
            return dom[..v_start].rfind('<');
        }
        from = v_end;
    }
    None
}

/// The `data-testid` element's text, or a failure that shows the page.
#[track_caller]
fn testid(dom: &str, id: &str) -> String {
    text_by(dom, "data-testid", id)
        .unwrap_or_else(|| panic!("no element data-testid={id:?} in the page:\n{dom}"))
}

/// The markup of the table row whose `attr` is `value`.
fn row<'a>(dom: &'a str, attr: &str, value: &str) -> Option<&'a str> {
    let start = element_start(dom, attr, value)?;
    let len = dom[start..].find("</tr>")?;
    Some(&dom[start..start + len])
}

/// The text of a cell (`data-col`) of a row.
#[track_caller]
fn cell(row: &str, col: &str) -> String {
    text_by(row, "data-col", col).unwrap_or_else(|| panic!("no cell {col:?} in row {row}"))
}

/// Every value of `attr` in the page, in order.
fn all_values(dom: &str, attr: &str) -> Vec<String> {
    let needle = format!(" {attr}=\"");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = dom[from..].find(&needle) {
        let v_start = from + i + needle.len();
        let Some(len) = dom[v_start..].find('"') else {
            break;
        };
        out.push(unescape(&dom[v_start..v_start + len]));
        from = v_start + len;
    }
    out
}

/// The page with every attribute value blanked: what is left is markup and text.
fn without_attribute_values(dom: &str) -> String {
    let mut out = String::with_capacity(dom.len());
    let mut rest = dom;
    while let Some(i) = rest.find("=\"") {
        out.push_str(&rest[..i + 2]);
        rest = &rest[i + 2..];
        match rest.find('"') {
            Some(j) => rest = &rest[j..],
            None => break,
        }
    }
    out.push_str(rest);
    out
}

async fn declare(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declare {name}: {e:?}"));
}

async fn publish(ch: &Channel, queue: &str, body: &str) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        BasicProperties::default().with_content_type("application/json".into()),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// The browser for a test of the page, or `None` (said why) when the test is to pass without one: against
/// an external broker, or where Chromium is missing and not required.
fn browser() -> Option<PathBuf> {
    if std::env::var_os("WARREN_TEST_URL").is_some_and(|v| !v.is_empty()) {
        eprintln!(
            "web_ui: skipped, WARREN_TEST_URL names an external broker (the page is Warren's)"
        );
        return None;
    }
    let found = chromium();
    if found.is_none() {
        if std::env::var("WARREN_TEST_REQUIRE_CHROMIUM").is_ok_and(|v| v == "1") {
            panic!(
                "WARREN_TEST_REQUIRE_CHROMIUM=1 but no chromium on the PATH (or WARREN_CHROMIUM)"
            );
        }
        eprintln!(
            "web_ui: SKIPPED, Chromium is not installed (apt-get install chromium, or set WARREN_CHROMIUM; \
             scripts/test installs it)"
        );
    }
    found
}

#[tokio::test]
async fn web_ui_shows_overview_queues_queue_and_connections() {
    let Some(chromium) = browser() else {
        return;
    };
    let broker = TestBroker::start();
    let http = broker
        .http_url()
        .expect("the management API is on")
        .to_owned();

    // ui-orders: 3 ready messages and an argument; ui-work: 1 ready, 1 unacked by a consumer that
    // stays connected; ui-empty; and a queue whose name is markup.
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut limit = FieldTable::default();
    limit.insert("x-delivery-limit".into(), AMQPValue::LongInt(5));
    declare(&ch, ORDERS, limit).await;
    declare(&ch, WORK, FieldTable::default()).await;
    declare(&ch, EMPTY, FieldTable::default()).await;
    declare(&ch, EVIL, FieldTable::default()).await;
    for n in 1..=3 {
        publish(&ch, ORDERS, &format!("{{\"order\":{n}}}")).await;
    }
    publish(&ch, WORK, "job-1").await;
    publish(&ch, WORK, "job-2").await;
    let worker = broker.connect().await;
    let wch = worker.create_channel().await.unwrap();
    wch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut consumer = wch
        .basic_consume(
            WORK.into(),
            "ui-worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let held = within("a delivery to the worker", consumer.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(held.data, b"job-1");

    let login = "user=guest&pass=guest";

    // A wrong password: the login form, with the server's reason.
    let dom = load(&chromium, format!("{http}/#/?user=guest&pass=wrong")).await;
    let form = open_tag(&dom, "data-testid", "login")
        .unwrap_or_else(|| panic!("no login form in the page:\n{dom}"));
    assert!(
        !form.contains(" hidden"),
        "the login form is hidden after a failed login:\n{dom}"
    );
    assert_eq!(testid(&dom, "login-reason"), "Login failed");

    // Overview: the totals of what was made above.
    let dom = view(&chromium, format!("{http}/#/?{login}")).await;
    for (id, want) in [
        ("total-queues", "4"),
        ("total-connections", "2"),
        ("total-channels", "2"),
        ("total-consumers", "1"),
        ("total-ready", "4"),
        ("total-unacked", "1"),
        ("total-messages", "5"),
    ] {
        assert_eq!(testid(&dom, id), want, "overview {id}");
    }
    for id in ["rate-publish", "rate-deliver", "rate-ack"] {
        assert!(testid(&dom, id).ends_with("/s"), "overview {id}");
    }
    assert_eq!(testid(&dom, "who"), "guest");

    // Queues: one row per queue with its counts, names shown as text.
    let dom = view(&chromium, format!("{http}/#/queues?{login}")).await;
    assert_eq!(
        all_values(&dom, "data-queue"),
        [EVIL, EMPTY, ORDERS, WORK],
        "queue rows in the default order (vhost, then name: ' ' sorts before '-')"
    );
    for (q, ready, unacked, total, consumers) in [
        (ORDERS, "3", "0", "3", "0"),
        (WORK, "1", "1", "2", "1"),
        (EMPTY, "0", "0", "0", "0"),
        (EVIL, "0", "0", "0", "0"),
    ] {
        let r = row(&dom, "data-queue", q).unwrap_or_else(|| panic!("no row for {q}:\n{dom}"));
        assert_eq!(cell(r, "vhost"), "/");
        assert_eq!(cell(r, "name"), q);
        assert_eq!(cell(r, "type"), "classic");
        assert_eq!(cell(r, "ready"), ready, "{q} ready");
        assert_eq!(cell(r, "unacked"), unacked, "{q} unacked");
        assert_eq!(cell(r, "messages"), total, "{q} total");
        assert_eq!(cell(r, "consumers"), consumers, "{q} consumers");
        assert!(cell(r, "publish-rate").ends_with("/s"));
        assert!(cell(r, "deliver-rate").ends_with("/s"));
    }
    // The ready messages' age: a number of seconds for ui-orders, none for the empty queue.
    let r = row(&dom, "data-queue", ORDERS).unwrap();
    assert!(cell(r, "oldest-age").ends_with('s'), "{r}");
    assert_eq!(
        cell(row(&dom, "data-queue", EMPTY).unwrap(), "oldest-age"),
        "–"
    );
    let markup = without_attribute_values(&dom);
    assert!(
        !markup.contains("<b>") && !markup.contains("<img"),
        "a queue name was inserted as markup:\n{dom}"
    );
    assert_eq!(
        testid(&dom, "list-count"),
        "4 of 4",
        "the count of shown and total queues"
    );

    // Filtered (regular expression), sorted by ready count descending, in pages of 1: page 2 of 2.
    let dom = view(
        &chromium,
        format!(
            "{http}/#/queues?name=%5Eui-(orders%7Cwork)%24&regex=1&sort=messages_ready&rev=1&size=1&page=2&{login}"
        ),
    )
    .await;
    assert_eq!(all_values(&dom, "data-queue"), [WORK]);
    assert_eq!(testid(&dom, "list-page"), "2 / 2");
    assert_eq!(testid(&dom, "list-count"), "2 of 4");
    let dom = view(
        &chromium,
        format!("{http}/#/queues?name=ORD&sort=name&{login}"),
    )
    .await;
    assert_eq!(all_values(&dom, "data-queue"), [ORDERS], "substring filter");

    // A queue's page: its counts, arguments, a requeueing peek at two messages, the redrive command.
    let dom = view(
        &chromium,
        format!("{http}/#/queues/%2F/{ORDERS}?peek=2&{login}"),
    )
    .await;
    assert_eq!(testid(&dom, "queue-name"), ORDERS);
    assert_eq!(testid(&dom, "queue-ready"), "3");
    assert_eq!(testid(&dom, "queue-unacked"), "0");
    assert_eq!(testid(&dom, "queue-messages"), "3");
    let args = row(&dom, "data-argument", "x-delivery-limit").expect("the argument row");
    assert_eq!(cell(args, "value"), "5");
    assert_eq!(testid(&dom, "get-count-shown"), "2 messages");
    assert_eq!(
        dom.matches("data-testid=\"message-payload\"").count(),
        2,
        "two peeked messages shown:\n{dom}"
    );
    // The first one's payload, as text.
    assert_eq!(testid(&dom, "message-payload"), "{\"order\":1}");
    // Not the default port: the command names the broker, the password left for the reader to fill in.
    assert_eq!(
        testid(&dom, "redrive-command"),
        format!(
            "warren redrive --from {ORDERS} --url amqp://guest:PASSWORD@127.0.0.1:{}/%2F",
            broker.addr().port()
        )
    );
    // The move button waits for a target queue.
    assert!(
        dom.contains("data-testid=\"move\" disabled"),
        "a disabled Move button:\n{dom}"
    );
    assert!(dom.contains("data-testid=\"graph-depth\""), "depth graph");
    assert!(dom.contains("data-testid=\"graph-rates\""), "rates graph");
    assert_eq!(testid(&dom, "queue-policy"), "none");
    // The queue with a consumer: its unacked message and the consumer's row; a policy.
    let set = warren_conformance::http::request(
        "PUT",
        &format!("{http}/api/policies/%2F/ui-policy"),
        Some(("guest", "guest")),
        &[],
        Some(&format!(
            r#"{{"pattern":"^{WORK}$","definition":{{"max-length-bytes":1000000}}}}"#
        )),
    );
    assert_eq!(set.status, 201, "{}", set.text());
    let dom = view(&chromium, format!("{http}/#/queues/%2F/{WORK}?{login}")).await;
    assert_eq!(testid(&dom, "queue-policy"), "ui-policy");
    assert_eq!(
        testid(&dom, "queue-effective-policy"),
        "{\"max-length-bytes\":1000000}"
    );
    assert_eq!(testid(&dom, "queue-ready"), "1");
    assert_eq!(testid(&dom, "queue-unacked"), "1");
    let c = row(&dom, "data-consumer", "ui-worker").expect("the consumer row");
    assert_eq!(cell(c, "ack"), "manual");
    assert_eq!(cell(c, "prefetch"), "1");
    // The markup name in a queue page (its path percent-encoded).
    let encoded: String = EVIL
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let dom = view(&chromium, format!("{http}/#/queues/%2F/{encoded}?{login}")).await;
    assert_eq!(testid(&dom, "queue-name"), EVIL);
    let markup = without_attribute_values(&dom);
    assert!(!markup.contains("<b>") && !markup.contains("<img"), "{dom}");

    // Connections: both lapin connections, with user, vhost, state, channels and client.
    let dom = view(&chromium, format!("{http}/#/connections?{login}")).await;
    let names = all_values(&dom, "data-connection");
    assert_eq!(names.len(), 2, "two connections listed:\n{dom}");
    for name in &names {
        let r = row(&dom, "data-connection", name).unwrap();
        assert_eq!(cell(r, "name"), *name);
        assert!(name.contains(&broker.addr().port().to_string()), "{name}");
        assert_eq!(cell(r, "user"), "guest");
        assert_eq!(cell(r, "vhost"), "/");
        assert_eq!(cell(r, "state"), "running");
        assert_eq!(cell(r, "channels"), "1");
        assert!(cell(r, "client").starts_with("lapin"), "{r}");
    }
    assert!(dom.contains("data-testid=\"close-connection\""));

    drop(held);
    let _ = worker.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;

    // Nodes: this node alone, running; "drained" while it is in maintenance mode.
    let dom = view(&chromium, format!("{http}/#/nodes?{login}")).await;
    let nodes = all_values(&dom, "data-node");
    assert_eq!(nodes.len(), 1, "one node listed:\n{dom}");
    let name = nodes[0].clone();
    let r = row(&dom, "data-node", &name).unwrap();
    assert_eq!(cell(r, "name"), format!("{name} (this node)"));
    assert_eq!(cell(r, "state"), "running");
    assert_eq!(cell(r, "maintenance"), "–");
    assert!(testid(&dom, "nodes-note").contains("of its own"), "{dom}");
    let maintenance = |on: bool| {
        let verb = if on { "drain" } else { "revive" };
        let url = format!("{http}/api/nodes/{name}/{verb}");
        let r =
            warren_conformance::http::request("POST", &url, Some(("guest", "guest")), &[], None);
        assert_eq!(r.status, 200, "{verb}: {}", r.text());
    };
    maintenance(true);
    let dom = view(&chromium, format!("{http}/#/nodes?{login}")).await;
    let r = row(&dom, "data-node", &name).unwrap();
    assert_eq!(cell(r, "maintenance"), "drained");
    maintenance(false);

    // Policies: a user policy and an operator policy, each in its table, the definition as JSON.
    let api = warren_conformance::http::Api::of(&broker);
    api.put(
        "/policies/%2F/ui-dlx",
        serde_json::json!({"pattern": "^ui-", "apply-to": "queues", "priority": 3,
            "definition": {"dead-letter-exchange": "ui-dead"}}),
    );
    api.put(
        "/operator-policies/%2F/ui-cap",
        serde_json::json!({"pattern": ".*", "apply-to": "queues", "definition": {"max-length": 1000}}),
    );
    let dom = view(&chromium, format!("{http}/#/policies?{login}")).await;
    let r = row(&dom, "data-policy", "ui-dlx").unwrap_or_else(|| panic!("no policy row:\n{dom}"));
    assert_eq!(cell(r, "vhost"), "/");
    assert_eq!(cell(r, "pattern"), "^ui-");
    assert_eq!(cell(r, "apply-to"), "queues");
    assert_eq!(cell(r, "priority"), "3");
    assert_eq!(
        cell(r, "definition"),
        r#"{"dead-letter-exchange":"ui-dead"}"#
    );
    let r = row(&dom, "data-policy", "ui-cap").unwrap();
    assert_eq!(cell(r, "definition"), r#"{"max-length":1000}"#);
    let operator =
        &dom[element_start(&dom, "data-testid", "operator-policies").expect("operator table")..];
    let in_table = operator
        .find("data-policy=\"ui-cap\"")
        .expect("the operator policy's row");
    assert!(
        in_table < operator.find("</table>").expect("the table's end"),
        "the operator policy is in the operator table:\n{dom}"
    );
    assert!(dom.contains("data-testid=\"policy-form\""));
    assert!(dom.contains("data-testid=\"delete-policy\""));
    // A policymaker manages user policies; operator policies are administrators' only.
    api.put(
        "/users/ui-pm",
        serde_json::json!({"password": "pm-secret", "tags": "policymaker"}),
    );
    api.put(
        "/permissions/%2F/ui-pm",
        serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"}),
    );
    let dom = view(
        &chromium,
        format!("{http}/#/policies?user=ui-pm&pass=pm-secret"),
    )
    .await;
    assert!(row(&dom, "data-policy", "ui-dlx").is_some(), "{dom}");
    assert!(row(&dom, "data-policy", "ui-cap").is_none(), "{dom}");
    assert_eq!(testid(&dom, "policies-forbidden"), "Administrators only");

    // Virtual hosts: one with metadata, its default queue type; the default vhost's description.
    api.put(
        "/vhosts/ui-billing",
        serde_json::json!({"description": "invoices", "tags": "eu,prod", "default_queue_type": "quorum"}),
    );
    let dom = view(&chromium, format!("{http}/#/vhosts?{login}")).await;
    let r = row(&dom, "data-vhost", "ui-billing").unwrap_or_else(|| panic!("no vhost row:\n{dom}"));
    assert_eq!(cell(r, "description"), "invoices");
    assert_eq!(cell(r, "tags"), "eu, prod");
    assert_eq!(cell(r, "default-queue-type"), "quorum");
    assert_eq!(cell(r, "ready"), "0");
    assert!(r.contains("data-testid=\"delete-vhost\""), "{r}");
    let r = row(&dom, "data-vhost", "/").unwrap();
    assert_eq!(cell(r, "description"), "Default virtual host");
    assert_eq!(cell(r, "default-queue-type"), "classic");
    assert!(dom.contains("data-testid=\"vhost-form\""));
    api.call("DELETE", "/vhosts/ui-billing", None);

    // Shovels: one on this broker, from ui-empty to a queue it declares, running.
    api.put(
        "/parameters/shovel/%2F/ui-move",
        serde_json::json!({"value": {"src-uri": "amqp://", "src-queue": EMPTY,
            "dest-uri": "amqp://", "dest-queue": "ui-moved"}}),
    );
    let start = std::time::Instant::now();
    loop {
        let (_, v) = api.call("GET", "/shovels/vhost/%2F/ui-move", None);
        if v["state"] == "running" {
            break;
        }
        assert!(
            start.elapsed() < warren_conformance::WAIT,
            "the shovel does not run: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dom = view(&chromium, format!("{http}/#/shovels?{login}")).await;
    let r = row(&dom, "data-shovel", "ui-move").unwrap_or_else(|| panic!("no shovel row:\n{dom}"));
    assert_eq!(cell(r, "state"), "running");
    assert_eq!(cell(r, "source"), format!("amqp:// · queue {EMPTY}"));
    assert_eq!(cell(r, "destination"), "amqp:// · queue ui-moved");
    assert_eq!(cell(r, "forwarded"), "0");
    assert!(r.contains("data-testid=\"restart-shovel\""), "{r}");

    // A queue moved by a shovel (src-delete-after queue-length) shows how far it is. Its
    // destination takes one message and refuses the next, so the move stays a third done.
    let mut one = FieldTable::default();
    one.insert("x-max-length".into(), AMQPValue::LongInt(1));
    one.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let mover = broker.connect().await;
    let ch = mover.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare(&ch, "ui-move-src", FieldTable::default()).await;
    declare(&ch, "ui-move-dest", one).await;
    for n in 1..=3 {
        publish(&ch, "ui-move-src", &format!("{{\"m\":{n}}}")).await;
    }
    api.put(
        "/parameters/shovel/%2F/ui-half",
        serde_json::json!({"value": {"src-uri": "amqp://", "src-queue": "ui-move-src",
            "src-delete-after": "queue-length", "dest-uri": "amqp://", "dest-queue": "ui-move-dest"}}),
    );
    let start = std::time::Instant::now();
    loop {
        let (_, v) = api.call("GET", "/shovels/vhost/%2F/ui-half", None);
        if v["forwarded"] == 1 && v["remaining"] == 2 {
            break;
        }
        assert!(
            start.elapsed() < warren_conformance::WAIT,
            "the shovel did not stop a third done: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dom = view(&chromium, format!("{http}/#/shovels?{login}")).await;
    let r = row(&dom, "data-shovel", "ui-half").unwrap_or_else(|| panic!("no shovel row:\n{dom}"));
    assert_eq!(cell(r, "forwarded"), "1 of 3");
    assert!(r.contains("data-testid=\"shovel-progress\""), "{r}");
}

/// A quorum queue's page on a cluster lists every node: its two members (x-quorum-initial-group-size 2)
/// as voters in the Raft group, one of them the leader, each with a button to take it off, and the third
/// node as a learner with a button to make it a member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_ui_shows_a_quorum_queues_members_on_a_cluster() {
    let Some(chromium) = browser() else {
        return;
    };
    let c = warren_conformance::cluster::TestCluster::start(3, 20);
    let q = warren_conformance::unique("ui-pair");
    c.declare_quorum_queue_with(
        1,
        &q,
        &[("x-quorum-initial-group-size", AMQPValue::LongLongInt(2))],
    )
    .await;
    let api = warren_conformance::http::Api::of(c.node(1));
    let name = |n: u64| {
        let (_, v) = warren_conformance::http::Api::of(c.node(n)).call("GET", "/overview", None);
        v["node"].as_str().expect("a node name").to_owned()
    };
    let names: Vec<String> = (1..=3).map(name).collect();
    // Until node 3's group has it as a learner and a leader is chosen, the page could show less.
    let start = Instant::now();
    loop {
        let (_, v) = api.call("GET", &format!("/queues/%2f/{q}/quorum-status"), None);
        let learners = v["learners"].as_array().map_or(0, Vec::len);
        if learners == 1 && v["leader"].is_string() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the group of {q}: {v}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let http = c.node(1).http_url().expect("the management API").to_owned();
    let dom = view(
        &chromium,
        format!("{http}/#/queues/%2F/{q}?user=guest&pass=guest"),
    )
    .await;
    let section =
        open_tag(&dom, "data-testid", "queue-members-section").expect("the members section");
    assert!(
        !section.contains(" hidden"),
        "the members section is hidden:\n{dom}"
    );
    let mut leaders = 0;
    for (i, node) in names.iter().enumerate() {
        let r =
            row(&dom, "data-member", node).unwrap_or_else(|| panic!("no row for {node}:\n{dom}"));
        let raft = cell(r, "raft");
        if i < 2 {
            assert_eq!(cell(r, "member"), "yes", "{r}");
            assert!(raft.starts_with("voter"), "{node}: {raft}");
            assert_eq!(cell(r, "online"), "yes", "{r}");
            assert!(r.contains("data-testid=\"member-delete\""), "{r}");
            leaders += usize::from(raft.contains("leader"));
        } else {
            assert_eq!(cell(r, "member"), "no", "{r}");
            assert_eq!(raft, "learner", "{r}");
            assert!(r.contains("data-testid=\"member-add\""), "{r}");
        }
    }
    assert_eq!(leaders, 1, "one leader among the members:\n{dom}");
}
