//! Access control as RabbitMQ applies it: which permission (configure, write, read) each
//! operation needs on which resource, the 403 texts, vhost access at connection.open, topic
//! permissions, and what deleting a user or a vhost does to their connections. Users,
//! permissions and objects are set up through the management API, so the same test runs
//! against RabbitMQ (`WARREN_TEST_URL` with `WARREN_TEST_HTTP_URL`).

use amq_protocol::protocol::AMQPClass;
use amq_protocol::types::{AMQPValue, FieldTable};
use serde_json::json;
use warren_conformance::http::request;
use warren_conformance::raw::{m, plain_response, Handshake, QueueFlags, Raw};
use warren_conformance::{unique, TestBroker};

const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

/// A user `u-TAG` allowed to configure `c-*`, write `w-*` (and amq.topic), read `r-*` in "/",
/// with queues and exchanges of each prefix made by guest.
struct Setup {
    b: TestBroker,
    api: String,
    tag: String,
    user: String,
}

impl Setup {
    fn new() -> Setup {
        let b = TestBroker::start();
        let api = format!("{}/api", b.http_url().expect("management API on"));
        let tag = unique("p");
        let user = format!("u-{tag}");
        let put = |path: &str, body: serde_json::Value| {
            let r = request(
                "PUT",
                &format!("{api}{path}"),
                GUEST,
                &[],
                Some(&body.to_string()),
            );
            assert!(
                r.status == 201 || r.status == 204,
                "PUT {path}: {}",
                r.status
            );
        };
        put(
            &format!("/users/{user}"),
            json!({"password": "pw", "tags": ""}),
        );
        put(
            &format!("/permissions/%2F/{user}"),
            json!({"configure": "^c-", "write": "^w-|^amq\\.topic$", "read": "^r-"}),
        );
        for p in ["c", "w", "r"] {
            put(&format!("/queues/%2F/{p}-{tag}"), json!({"durable": false}));
            put(
                &format!("/exchanges/%2F/{p}-{tag}-x"),
                json!({"type": "topic", "durable": false}),
            );
        }
        Setup { b, api, tag, user }
    }

    fn name(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.tag)
    }

    async fn connect(&self, vhost: &str) -> Raw {
        let mut raw = Raw::tcp(self.b.addr()).await;
        raw.handshake_until_open(&Handshake {
            response: plain_response(&self.user, "pw"),
            vhost: vhost.into(),
            ..Handshake::default()
        })
        .await;
        raw
    }

    fn refused(&self, kind: &str, name: &str) -> String {
        format!(
            "ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{}'",
            self.user
        )
    }

    fn delete(&self, path: &str) -> u16 {
        request("DELETE", &format!("{}{path}", self.api), GUEST, &[], None).status
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // Leave a shared RabbitMQ as it was (a spawned broker goes with its data).
        if !self.b.is_external() {
            return;
        }
        self.delete(&format!("/users/{}", self.user));
        for p in ["c", "w", "r"] {
            self.delete(&format!("/queues/%2F/{p}-{}", self.tag));
            self.delete(&format!("/exchanges/%2F/{p}-{}-x", self.tag));
        }
    }
}

fn open_ok(raw_reply: (u16, AMQPClass)) {
    assert!(
        matches!(
            raw_reply.1,
            AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::OpenOk(_))
        ),
        "expected connection.open-ok, got {raw_reply:?}"
    );
}

fn args(key: &str, value: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(key.into(), AMQPValue::LongString(value.into()));
    t
}

/// An operation, and the resource (kind, name) it is refused on, if it is.
type Case<'a> = (&'a str, AMQPClass, Option<(&'a str, String)>);

/// Each operation with the permission it needs: allowed (None) or refused on a resource.
#[tokio::test]
async fn each_operation_needs_the_permission_rabbitmq_asks_for() {
    let s = Setup::new();
    let (c, w, r) = (s.name("c"), s.name("w"), s.name("r"));
    let (cx, wx, rx) = (format!("{c}-x"), format!("{w}-x"), format!("{r}-x"));
    let x = s.name("x");
    let new_c = s.name("c-new");
    let flags = QueueFlags::default();
    let passive = QueueFlags {
        passive: true,
        ..QueueFlags::default()
    };
    let cases: Vec<Case> = vec![
        (
            "declare a queue outside configure",
            m::queue_declare(&x, flags),
            Some(("queue", x.clone())),
        ),
        (
            "declare a queue inside configure",
            m::queue_declare(&c, flags),
            None,
        ),
        (
            "passive declare needs nothing",
            m::queue_declare(&w, passive),
            None,
        ),
        (
            "a new queue with a DLX needs read on it",
            m::queue_declare_args(&new_c, flags, args("x-dead-letter-exchange", &wx)),
            Some(("queue", new_c.clone())),
        ),
        (
            "declare an exchange outside configure",
            m::exchange_declare(&x, "direct", false, false),
            Some(("exchange", x.clone())),
        ),
        (
            "redeclare an exchange inside configure",
            m::exchange_declare(&cx, "topic", false, false),
            None,
        ),
        (
            "passive exchange declare needs nothing",
            m::exchange_declare(&wx, "topic", true, false),
            None,
        ),
        (
            "delete a queue outside configure",
            m::queue_delete(&w, false, false),
            Some(("queue", w.clone())),
        ),
        (
            "delete a missing queue outside configure",
            m::queue_delete(&x, false, false),
            Some(("queue", x.clone())),
        ),
        (
            "delete an exchange outside configure",
            m::exchange_delete(&wx),
            Some(("exchange", wx.clone())),
        ),
        (
            "purge needs read",
            m::queue_purge(&c),
            Some(("queue", c.clone())),
        ),
        ("purge with read", m::queue_purge(&r), None),
        (
            "get needs read",
            m::basic_get(&c, true),
            Some(("queue", c.clone())),
        ),
        (
            "consume needs read",
            m::basic_consume(&w, "t", true, false),
            Some(("queue", w.clone())),
        ),
        (
            "consume with read",
            m::basic_consume(&r, "t", true, false),
            None,
        ),
        (
            "bind needs write on the queue",
            m::queue_bind(&c, &rx, "k"),
            Some(("queue", c.clone())),
        ),
        (
            "bind needs read on the exchange",
            m::queue_bind(&w, &cx, "k"),
            Some(("exchange", cx.clone())),
        ),
        (
            "bind with write and read",
            m::queue_bind(&w, &rx, "k"),
            None,
        ),
        (
            "unbind as bind",
            m::queue_unbind(&c, &rx, "k"),
            Some(("queue", c.clone())),
        ),
        (
            "exchange bind needs write on the destination",
            m::exchange_bind(&cx, &rx, "k"),
            Some(("exchange", cx.clone())),
        ),
        (
            "exchange bind needs read on the source",
            m::exchange_bind(&wx, &cx, "k"),
            Some(("exchange", cx.clone())),
        ),
        (
            "exchange bind with write and read",
            m::exchange_bind(&wx, &rx, "k"),
            None,
        ),
    ];
    let mut raw = s.connect("/").await;
    open_ok(raw.recv_method().await);
    for (i, (what, method, refusal)) in cases.into_iter().enumerate() {
        let ch = u16::try_from(i + 1).unwrap();
        raw.channel_open(ch).await;
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        match refusal {
            None => {
                raw.call(ch, method).await;
            }
            Some((kind, name)) => {
                raw.send(ch, method).await;
                let close = raw.recv_channel_close(ch).await;
                assert_eq!(
                    (
                        close.reply_code,
                        close.reply_text.as_str(),
                        close.class_id,
                        close.method_id
                    ),
                    (403, s.refused(kind, &name).as_str(), class_id, method_id),
                    "{what}"
                );
            }
        }
    }
}

/// Publishing needs write on the exchange (the default one is `amq.default`), and on a topic
/// exchange with topic permissions, a routing key they allow.
#[tokio::test]
async fn publishing_needs_write_and_topic_permissions_filter_keys() {
    let s = Setup::new();
    let r = request(
        "PUT",
        &format!("{}/topic-permissions/%2F/{}", s.api, s.user),
        GUEST,
        &[],
        Some(&json!({"exchange": "amq.topic", "write": "^ok\\.", "read": ".*"}).to_string()),
    );
    assert_eq!(r.status, 201);
    let (w, wx, cx) = (
        s.name("w"),
        format!("{}-x", s.name("w")),
        format!("{}-x", s.name("c")),
    );
    let mut raw = s.connect("/").await;
    open_ok(raw.recv_method().await);
    let cases: Vec<(&str, &str, Option<String>)> = vec![
        (wx.as_str(), "k", None),
        (cx.as_str(), "k", Some(s.refused("exchange", &cx))),
        ("", w.as_str(), Some(s.refused("exchange", "amq.default"))),
        ("amq.topic", "ok.1", None),
        (
            "amq.topic",
            "bad",
            Some(format!(
                "ACCESS_REFUSED - access to topic 'bad' in exchange 'amq.topic' in vhost '/' refused for user '{}'",
                s.user
            )),
        ),
    ];
    for (i, (exchange, key, refusal)) in cases.into_iter().enumerate() {
        let ch = u16::try_from(i + 1).unwrap();
        raw.channel_open(ch).await;
        raw.publish(ch, exchange, key, false, Default::default(), b"m")
            .await;
        match refusal {
            // Nothing comes back for an allowed publish: a passive declare after it answers.
            None => {
                let passive = QueueFlags {
                    passive: true,
                    ..QueueFlags::default()
                };
                raw.call(ch, m::queue_declare(&w, passive)).await;
            }
            Some(text) => raw.expect_channel_close(ch, 403, &text, 60, 40).await,
        }
    }
}

/// A user without a permission in a vhost cannot open it (530), and deleting a user or a vhost
/// closes their connections with 320.
#[tokio::test]
async fn vhost_access_and_deletions_close_connections() {
    let s = Setup::new();
    let vhost = s.name("vh");
    let r = request(
        "PUT",
        &format!("{}/vhosts/{vhost}", s.api),
        GUEST,
        &[],
        None,
    );
    assert_eq!(r.status, 201);
    let mut raw = s.connect(&vhost).await;
    raw.expect_connection_close(
        530,
        &format!(
            "NOT_ALLOWED - access to vhost '{vhost}' refused for user '{}'",
            s.user
        ),
        10,
        40,
    )
    .await;

    // Guest in the new vhost (whoever makes a vhost through the API gets all permissions in
    // it, as from RabbitMQ), the user in "/": each deletion closes its own connections.
    let r = request(
        "GET",
        &format!("{}/permissions/{vhost}/guest", s.api),
        GUEST,
        &[],
        None,
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["write"], ".*");
    let mut guest = Raw::tcp(s.b.addr()).await;
    guest
        .handshake_until_open(&Handshake {
            vhost: vhost.clone(),
            ..Handshake::default()
        })
        .await;
    open_ok(guest.recv_method().await);
    let mut user = s.connect("/").await;
    open_ok(user.recv_method().await);

    assert_eq!(s.delete(&format!("/vhosts/{vhost}")), 204);
    guest
        .expect_connection_close(
            320,
            &format!("CONNECTION_FORCED - vhost '{vhost}' is deleted"),
            0,
            0,
        )
        .await;
    assert_eq!(s.delete(&format!("/vhosts/{vhost}")), 404);

    assert_eq!(s.delete(&format!("/users/{}", s.user)), 204);
    user.expect_connection_close(
        320,
        &format!("CONNECTION_FORCED - user '{}' is deleted", s.user),
        0,
        0,
    )
    .await;
}

/// Users, permissions and vhosts made through the API outlive a kill -9 right after their
/// answer (the API answers once the change is on disk), as do deletions.
#[tokio::test]
async fn users_and_permissions_survive_a_restart() {
    let mut s = Setup::new();
    if s.b.is_external() {
        return; // restarts only the broker this test started
    }
    let vhost = s.name("vh");
    let r = request(
        "PUT",
        &format!("{}/vhosts/{vhost}", s.api),
        GUEST,
        &[],
        None,
    );
    assert_eq!(r.status, 201);
    s.b.restart(true);
    let api = format!("{}/api", s.b.http_url().expect("management API on"));
    s.api = api.clone();
    let perm = request(
        "GET",
        &format!("{api}/permissions/%2F/{}", s.user),
        GUEST,
        &[],
        None,
    );
    assert_eq!(perm.status, 200);
    assert_eq!(perm.json()["configure"], "^c-");
    let vh = request("GET", &format!("{api}/vhosts/{vhost}"), GUEST, &[], None);
    assert_eq!(vh.status, 200);
    // The user still logs in with the password set before the restart.
    let mut raw = s.connect("/").await;
    open_ok(raw.recv_method().await);
    raw.close().await;
    // A deleted guest stays deleted: the built-in default is made on a new node only.
    let admin = format!("a-{}", s.tag);
    let r = request(
        "PUT",
        &format!("{api}/users/{admin}"),
        GUEST,
        &[],
        Some(&json!({"password": "pw", "tags": "administrator"}).to_string()),
    );
    assert_eq!(r.status, 201);
    let as_admin = Some((admin.as_str(), "pw"));
    assert_eq!(
        request("DELETE", &format!("{api}/users/guest"), as_admin, &[], None).status,
        204
    );
    s.b.restart(true);
    let api = format!("{}/api", s.b.http_url().expect("management API on"));
    let who = request("GET", &format!("{api}/whoami"), GUEST, &[], None);
    assert_eq!(who.status, 401, "guest came back after a restart");
    let who = request("GET", &format!("{api}/whoami"), as_admin, &[], None);
    assert_eq!(who.status, 200);
}
