//! The management API checks a user's vhost permissions as RabbitMQ's management plugin does:
//! an operation on a resource needs the permission its AMQP counterpart needs (declare and
//! delete: configure; publish: write; get and purge: read; a binding: write on the
//! destination and read on the source), and is refused with the answer RabbitMQ's API gives
//! for that operation, which depends on how its handler reaches the broker. A user without
//! the administrator tag sees only the vhosts where it has a permission. Every expectation
//! was recorded from RabbitMQ 3.10.8; with `WARREN_TEST_URL` and `WARREN_TEST_HTTP_URL` the
//! same tests run against it.

use serde_json::{json, Value};
use warren_conformance::http::{eventually, request};
use warren_conformance::raw::{m, plain_response, Handshake, Raw};
use warren_conformance::{unique, TestBroker};

const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

/// A `management` user `m-TAG` allowed to configure `^c-`, write `^w-` and `amq.default`,
/// read `^r-` in "/", queues and topic exchanges of each prefix made by guest, a binding
/// guest made from `c-TAG-x` to `w-TAG`, and a vhost `v-TAG` (with a queue `q`) where the
/// user has no permission.
struct Setup {
    b: TestBroker,
    api: String,
    tag: String,
    user: String,
    vhost: String,
}

fn put_ok(api: &str, path: &str, body: Value) {
    let r = request(
        "PUT",
        &format!("{api}{path}"),
        GUEST,
        &[],
        Some(&body.to_string()),
    );
    assert!(
        r.status == 201 || r.status == 204,
        "PUT {path}: {} {}",
        r.status,
        r.text()
    );
}

impl Setup {
    fn new(tags: &str, write: &str) -> Setup {
        let b = TestBroker::start();
        let api = format!("{}/api", b.http_url().expect("management API on"));
        let tag = unique("ap");
        let user = format!("m-{tag}");
        let vhost = format!("v-{tag}");
        put_ok(
            &api,
            &format!("/users/{user}"),
            json!({"password": "pw", "tags": tags}),
        );
        put_ok(
            &api,
            &format!("/permissions/%2F/{user}"),
            json!({"configure": "^c-", "write": write, "read": "^r-"}),
        );
        for p in ["c", "w", "r"] {
            put_ok(
                &api,
                &format!("/queues/%2F/{p}-{tag}"),
                json!({"durable": false}),
            );
            put_ok(
                &api,
                &format!("/exchanges/%2F/{p}-{tag}-x"),
                json!({"type": "topic", "durable": false}),
            );
        }
        let r = request(
            "POST",
            &format!("{api}/bindings/%2F/e/c-{tag}-x/q/w-{tag}"),
            GUEST,
            &[],
            Some(r#"{"routing_key":"k"}"#),
        );
        assert_eq!(r.status, 201, "guest's binding: {}", r.text());
        // Whoever makes a vhost through the API gets every permission in it (both brokers).
        put_ok(&api, &format!("/vhosts/{vhost}"), json!({}));
        put_ok(&api, &format!("/queues/{vhost}/q"), json!({}));
        Setup {
            b,
            api,
            tag,
            user,
            vhost,
        }
    }

    fn name(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.tag)
    }

    /// `method path` as the test user.
    fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Option<Value>) {
        let r = request(
            method,
            &format!("{}{path}", self.api),
            Some((&self.user, "pw")),
            &[],
            body,
        );
        let v = (!r.body.is_empty()).then(|| r.json());
        (r.status, v)
    }

    fn guest(&self, method: &str, path: &str) -> u16 {
        request(method, &format!("{}{path}", self.api), GUEST, &[], None).status
    }

    /// RabbitMQ's text for an AMQP refusal of this user in "/".
    fn refused(&self, kind: &str, name: &str) -> String {
        format!(
            "ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{}'",
            self.user
        )
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // Leave a shared RabbitMQ as it was (a spawned broker goes with its data).
        if !self.b.is_external() {
            return;
        }
        self.guest("DELETE", &format!("/users/{}", self.user));
        self.guest("DELETE", &format!("/vhosts/{}", self.vhost));
        for p in ["c", "w", "r"] {
            self.guest("DELETE", &format!("/queues/%2F/{p}-{}", self.tag));
            self.guest("DELETE", &format!("/exchanges/%2F/{p}-{}-x", self.tag));
        }
    }
}

fn not_authorised(reason: &str) -> Option<Value> {
    Some(json!({"error": "not_authorised", "reason": reason}))
}

/// What `direct_request` operations (declare, delete, purge, bind, unbind) answer.
fn access_refused() -> Option<Value> {
    not_authorised("Access refused.")
}

const GET: &str = r#"{"count":1,"ackmode":"ack_requeue_true","encoding":"auto"}"#;

fn publish_body() -> String {
    json!({"routing_key": "k", "payload": "x", "payload_encoding": "string", "properties": {}})
        .to_string()
}

/// An API call, the status it must get and the body (None: not checked, for 201/204 whose
/// body is empty).
type Row = (
    &'static str,
    &'static str,
    String,
    Option<String>,
    u16,
    Option<Value>,
);

/// Each operation of the API on a resource, with and without the permission it needs.
#[test]
fn each_api_operation_needs_the_permission_rabbitmq_asks_for() {
    let s = Setup::new("management", "^w-|^amq\\.default$");
    let (c, w, r) = (s.name("c"), s.name("w"), s.name("r"));
    let (cx, wx, rx) = (format!("{c}-x"), format!("{w}-x"), format!("{r}-x"));
    let (new_c, new_x) = (s.name("c-new"), s.name("x-new"));
    let (missing_x, missing_r) = (s.name("x-missing"), s.name("r-missing"));
    let publish = Some(publish_body());
    let key = Some(r#"{"routing_key":"k2"}"#.to_string());
    let rows: Vec<Row> = vec![
        (
            "declare a queue inside configure",
            "PUT",
            format!("/queues/%2F/{new_c}"),
            Some("{}".into()),
            201,
            None,
        ),
        (
            "delete a queue inside configure",
            "DELETE",
            format!("/queues/%2F/{new_c}"),
            None,
            204,
            None,
        ),
        (
            "declare a queue outside configure",
            "PUT",
            format!("/queues/%2F/{new_x}"),
            Some("{}".into()),
            401,
            access_refused(),
        ),
        (
            "a new queue with a DLX needs read on it",
            "PUT",
            format!("/queues/%2F/{new_c}"),
            Some(json!({"arguments": {"x-dead-letter-exchange": wx}}).to_string()),
            401,
            access_refused(),
        ),
        (
            "delete a queue outside configure",
            "DELETE",
            format!("/queues/%2F/{r}"),
            None,
            401,
            access_refused(),
        ),
        (
            "deleting a missing queue is a 404 first",
            "DELETE",
            format!("/queues/%2F/{missing_x}"),
            None,
            404,
            Some(json!({"error": "Object Not Found", "reason": "Not Found"})),
        ),
        (
            "declare an exchange inside configure",
            "PUT",
            format!("/exchanges/%2F/{new_c}"),
            Some(r#"{"type":"direct"}"#.into()),
            201,
            None,
        ),
        (
            "delete an exchange inside configure",
            "DELETE",
            format!("/exchanges/%2F/{new_c}"),
            None,
            204,
            None,
        ),
        (
            "declare an exchange outside configure",
            "PUT",
            format!("/exchanges/%2F/{new_x}"),
            Some(r#"{"type":"direct"}"#.into()),
            401,
            access_refused(),
        ),
        (
            "delete an exchange outside configure",
            "DELETE",
            format!("/exchanges/%2F/{rx}"),
            None,
            401,
            access_refused(),
        ),
        (
            "get needs read (the channel's text)",
            "POST",
            format!("/queues/%2F/{c}/get"),
            Some(GET.into()),
            401,
            not_authorised(&s.refused("queue", &c)),
        ),
        (
            "get with read",
            "POST",
            format!("/queues/%2F/{r}/get"),
            Some(GET.into()),
            200,
            Some(json!([])),
        ),
        (
            "get is checked before the queue is looked up",
            "POST",
            format!("/queues/%2F/{missing_x}/get"),
            Some(GET.into()),
            401,
            not_authorised(&s.refused("queue", &missing_x)),
        ),
        (
            "get of a missing queue with read",
            "POST",
            format!("/queues/%2F/{missing_r}/get"),
            Some(GET.into()),
            404,
            Some(
                json!({"error": "not_found", "reason": format!("NOT_FOUND - no queue '{missing_r}' in vhost '/'")}),
            ),
        ),
        (
            "purge needs read",
            "DELETE",
            format!("/queues/%2F/{c}/contents"),
            None,
            401,
            access_refused(),
        ),
        (
            "purge with read",
            "DELETE",
            format!("/queues/%2F/{r}/contents"),
            None,
            204,
            None,
        ),
        (
            "purging a missing queue is a 404 first",
            "DELETE",
            format!("/queues/%2F/{missing_x}/contents"),
            None,
            404,
            Some(json!({"error": "Object Not Found", "reason": "Not Found"})),
        ),
        (
            "publish needs write (a 400 with the channel error)",
            "POST",
            format!("/exchanges/%2F/{cx}/publish"),
            publish.clone(),
            400,
            Some(
                json!({"error": "bad_request", "reason": format!("403 {}", s.refused("exchange", &cx))}),
            ),
        ),
        (
            "publish with write",
            "POST",
            format!("/exchanges/%2F/{wx}/publish"),
            publish.clone(),
            200,
            Some(json!({"routed": false})),
        ),
        (
            "publish to amq.default with write on it",
            "POST",
            "/exchanges/%2F/amq.default/publish".into(),
            publish.clone(),
            200,
            Some(json!({"routed": false})),
        ),
        (
            "publish to amq.direct without write on it",
            "POST",
            "/exchanges/%2F/amq.direct/publish".into(),
            publish.clone(),
            400,
            Some(
                json!({"error": "bad_request", "reason": format!("403 {}", s.refused("exchange", "amq.direct"))}),
            ),
        ),
        (
            "publish is checked before the exchange is looked up",
            "POST",
            format!("/exchanges/%2F/{missing_x}/publish"),
            publish.clone(),
            400,
            Some(
                json!({"error": "bad_request", "reason": format!("403 {}", s.refused("exchange", &missing_x))}),
            ),
        ),
        (
            "bind read source to write queue",
            "POST",
            format!("/bindings/%2F/e/{rx}/q/{w}"),
            key.clone(),
            201,
            None,
        ),
        (
            "unbind it",
            "DELETE",
            format!("/bindings/%2F/e/{rx}/q/{w}/k2"),
            None,
            204,
            None,
        ),
        (
            "bind to a queue without write",
            "POST",
            format!("/bindings/%2F/e/{rx}/q/{c}"),
            key.clone(),
            401,
            access_refused(),
        ),
        (
            "bind from an exchange without read",
            "POST",
            format!("/bindings/%2F/e/{wx}/q/{w}"),
            key.clone(),
            401,
            access_refused(),
        ),
        (
            "bind read exchange to write exchange",
            "POST",
            format!("/bindings/%2F/e/{rx}/e/{wx}"),
            key.clone(),
            201,
            None,
        ),
        (
            "bind to an exchange without write",
            "POST",
            format!("/bindings/%2F/e/{rx}/e/{rx}"),
            key.clone(),
            401,
            access_refused(),
        ),
        (
            "unbind without read on the source",
            "DELETE",
            format!("/bindings/%2F/e/{cx}/q/{w}/k"),
            None,
            401,
            access_refused(),
        ),
        (
            "aliveness test needs configure on its queue",
            "GET",
            "/aliveness-test/%2F".into(),
            None,
            401,
            not_authorised(&s.refused("queue", "aliveness-test")),
        ),
        (
            "one vhost is for administrators",
            "GET",
            "/vhosts/%2F".into(),
            None,
            401,
            not_authorised("Not administrator user"),
        ),
    ];
    let mut failures = Vec::new();
    for (what, method, path, body, status, expected) in &rows {
        let (got, v) = s.call(method, path, body.as_deref());
        if got != *status || (expected.is_some() && v != *expected) {
            failures.push(format!(
                "{what}: {method} {path}: expected {status} {expected:?}, got {got} {v:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// In a vhost where it has no permission, a user without the administrator tag gets
/// RabbitMQ's 401 for every path naming it, sees none of its objects in the lists, and only
/// its own consumers (there, as anywhere).
#[test]
fn a_vhost_without_permission_is_invisible_to_non_administrators() {
    let s = Setup::new("management", "^w-");
    let v = s.vhost.clone();
    let hidden = not_authorised("User not authorised to access virtual host");
    let get = Some(GET.to_string());
    let publish = Some(publish_body());
    let rows: Vec<Row> = vec![
        (
            "queues of the vhost",
            "GET",
            format!("/queues/{v}"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "one queue",
            "GET",
            format!("/queues/{v}/q"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "declare",
            "PUT",
            format!("/queues/{v}/c-q"),
            Some("{}".into()),
            401,
            hidden.clone(),
        ),
        (
            "delete",
            "DELETE",
            format!("/queues/{v}/q"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "get",
            "POST",
            format!("/queues/{v}/q/get"),
            get,
            401,
            hidden.clone(),
        ),
        (
            "purge",
            "DELETE",
            format!("/queues/{v}/q/contents"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "queue bindings",
            "GET",
            format!("/queues/{v}/q/bindings"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "exchanges of the vhost",
            "GET",
            format!("/exchanges/{v}"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "one exchange",
            "GET",
            format!("/exchanges/{v}/amq.direct"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "publish",
            "POST",
            format!("/exchanges/{v}/amq.default/publish"),
            publish,
            401,
            hidden.clone(),
        ),
        (
            "bindings of the vhost",
            "GET",
            format!("/bindings/{v}"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "bind",
            "POST",
            format!("/bindings/{v}/e/amq.direct/q/q"),
            Some("{}".into()),
            401,
            hidden.clone(),
        ),
        (
            "connections of the vhost",
            "GET",
            format!("/vhosts/{v}/connections"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "channels of the vhost",
            "GET",
            format!("/vhosts/{v}/channels"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "aliveness test",
            "GET",
            format!("/aliveness-test/{v}"),
            None,
            401,
            hidden.clone(),
        ),
        (
            "consumers are filtered, not refused",
            "GET",
            format!("/consumers/{v}"),
            None,
            200,
            Some(json!([])),
        ),
        (
            "a missing vhost is a 404",
            "GET",
            format!("/queues/{v}-missing"),
            None,
            404,
            Some(json!({"error": "Object Not Found", "reason": "Not Found"})),
        ),
    ];
    let mut failures = Vec::new();
    for (what, method, path, body, status, expected) in &rows {
        let (got, body) = s.call(method, path, body.as_deref());
        if got != *status || (expected.is_some() && body != *expected) {
            failures.push(format!(
                "{what}: {method} {path}: expected {status} {expected:?}, got {got} {body:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    let vhosts_of = |path: &str| -> Vec<String> {
        let (status, body) = s.call("GET", path, None);
        assert_eq!(status, 200, "GET {path}");
        body.and_then(|b| b.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|x| x.get("vhost").or_else(|| x.get("name")))
            .filter_map(|x| x.as_str().map(str::to_owned))
            .collect()
    };
    for list in ["/queues", "/exchanges", "/bindings"] {
        let seen = vhosts_of(list);
        assert!(seen.iter().any(|x| x == "/"), "{list} shows /: {seen:?}");
        assert!(!seen.contains(&v), "{list} hides {v}: {seen:?}");
    }
    let names = vhosts_of("/vhosts");
    assert!(
        names.iter().any(|x| x == "/") && !names.contains(&v),
        "vhosts: {names:?}"
    );
}

/// An administrator is refused too where it has no permission: its tag opens the API, not
/// the vhost's resources (RabbitMQ's API acts through a connection of the user).
#[test]
fn administrators_need_permissions_to_act_in_a_vhost() {
    let s = Setup::new("management", "^w-");
    let v = s.vhost.clone();
    assert_eq!(s.guest("DELETE", &format!("/permissions/{v}/guest")), 204);
    let as_guest = |method: &str, path: &str, body: &str| {
        let r = request(method, &format!("{}{path}", s.api), GUEST, &[], Some(body));
        (r.status, r.json())
    };
    let refused = (
        401,
        json!({"error": "not_authorised", "reason": "Access refused."}),
    );
    assert_eq!(as_guest("PUT", &format!("/queues/{v}/q2"), "{}"), refused);
    assert_eq!(
        as_guest("POST", &format!("/queues/{v}/q/get"), GET),
        refused
    );
    assert_eq!(
        as_guest(
            "POST",
            &format!("/exchanges/{v}/amq.default/publish"),
            &publish_body()
        ),
        refused
    );
    // Seeing is not acting: the lists still show the vhost's objects to an administrator.
    let r = request("GET", &format!("{}/queues/{v}", s.api), GUEST, &[], None);
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A monitoring user sees every connection, channel and consumer (of any vhost), and every
/// vhost's name, but not the queues of a vhost where it has no permission; a management
/// user sees only its own consumers. Neither may close another user's connection.
#[tokio::test]
async fn monitoring_sees_connections_everywhere_but_objects_only_in_its_vhosts() {
    let s = Setup::new("monitoring", "^w-");
    let v = s.vhost.clone();
    // Guest (who made the vhost) consumes there.
    let mut raw = Raw::tcp(s.b.addr()).await;
    raw.handshake_until_open(&Handshake {
        response: plain_response("guest", "guest"),
        vhost: v.clone(),
        ..Handshake::default()
    })
    .await;
    raw.recv_method().await;
    raw.channel_open(1).await;
    raw.call(1, m::basic_consume("q", "t", true, false)).await;

    let conn = eventually("guest's connection in the list", || {
        let (status, body) = s.call("GET", "/connections", None);
        body.and_then(|b| b.as_array().cloned())
            .unwrap_or_default()
            .into_iter()
            .find(|c| c["vhost"] == json!(v))
            .and_then(|c| c["name"].as_str().map(str::to_owned))
            .ok_or(format!("{status}"))
    });
    eventually("guest's consumer in the list", || {
        let (_, body) = s.call("GET", "/consumers", None);
        let all = body.and_then(|b| b.as_array().cloned()).unwrap_or_default();
        all.iter()
            .any(|c| c["queue"]["vhost"] == json!(v))
            .then_some(())
            .ok_or(format!("{all:?}"))
    });
    let (status, _) = s.call("GET", &format!("/queues/{v}"), None);
    assert_eq!(status, 401);
    let (_, names) = s.call("GET", "/vhosts", None);
    assert!(
        names
            .unwrap_or_default()
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["name"] == json!(v))),
        "a monitoring user lists every vhost"
    );
    let path = format!("/connections/{}", encode(&conn));
    let (status, body) = s.call("DELETE", &path, None);
    assert_eq!(
        (status, body),
        (401, not_authorised("User not authorised to access object"))
    );
    // It lists guest's connections by user name and reads guest's channel, but cannot close
    // them (RabbitMQ 3.10.8 fails that DELETE with a 500, Warren answers 401).
    let (status, body) = s.call("GET", "/connections/username/guest", None);
    let listed = body.and_then(|b| b.as_array().cloned()).unwrap_or_default();
    assert!(
        status == 200
            && listed.iter().any(|c| c["name"] == json!(conn)
                && c["vhost"] == json!(v)
                && c["user"] == "guest"),
        "{status} {listed:?}"
    );
    let channel = format!("/channels/{}", encode(&format!("{conn} (1)")));
    let (status, body) = s.call("GET", &channel, None);
    assert_eq!(status, 200);
    assert_eq!(body.map(|b| b["user"].clone()), Some(json!("guest")));
    // RabbitMQ's 500 keeps the HTTP connection open without a length: only Warren is asked.
    if !s.b.is_external() {
        let (status, body) = s.call("DELETE", "/connections/username/guest", None);
        assert_eq!(
            (status, body),
            (401, not_authorised("User not authorised to access object"))
        );
    }
    assert_eq!(
        s.call("GET", &path, None).0,
        200,
        "guest's connection is still open"
    );

    // A management user in "/" sees neither guest's consumer nor its connection.
    let m = format!("{}-mgmt", s.user);
    put_ok(
        &s.api,
        &format!("/users/{m}"),
        json!({"password": "pw", "tags": "management"}),
    );
    put_ok(
        &s.api,
        &format!("/permissions/%2F/{m}"),
        json!({"configure": "", "write": "", "read": ""}),
    );
    let as_m = |path: &str| {
        let r = request(
            "GET",
            &format!("{}{path}", s.api),
            Some((&m, "pw")),
            &[],
            None,
        );
        (r.status, r.json())
    };
    assert_eq!(as_m("/consumers"), (200, json!([])));
    assert_eq!(as_m(&format!("/consumers/{v}")), (200, json!([])));
    let refused =
        json!({"error": "not_authorised", "reason": "User not authorised to access object"});
    assert_eq!(as_m(&path), (401, refused.clone()));
    assert_eq!(as_m(&channel), (401, refused.clone()));
    // Another user's connections by name (RabbitMQ 3.10.8 fails with a 500, as above).
    if !s.b.is_external() {
        assert_eq!(as_m("/connections/username/guest"), (401, refused));
    }
    s.guest("DELETE", &format!("/users/{m}"));
}

/// Warren's own `POST /api/queues/{vhost}/{name}/move` is a get from the source and a
/// publish through the default exchange: it needs read on the source and write on
/// `amq.default`, and is refused with the channel's text, as `get` is.
#[test]
fn move_needs_read_on_the_source_and_write_on_the_default_exchange() {
    let s = Setup::new("management", "^w-");
    if s.b.is_external() {
        eprintln!("skipped: move is Warren's own endpoint");
        return;
    }
    let (c, w, r) = (s.name("c"), s.name("w"), s.name("r"));
    let body = Some(json!({"destination": w}).to_string());
    let rows: Vec<Row> = vec![
        (
            "move needs read on the source",
            "POST",
            format!("/queues/%2F/{c}/move"),
            body.clone(),
            401,
            not_authorised(&s.refused("queue", &c)),
        ),
        (
            "move needs write on amq.default",
            "POST",
            format!("/queues/%2F/{r}/move"),
            body.clone(),
            401,
            not_authorised(&s.refused("exchange", "amq.default")),
        ),
    ];
    for (what, method, path, body, status, expected) in &rows {
        let (got, v) = s.call(method, path, body.as_deref());
        assert_eq!((got, v), (*status, expected.clone()), "{what}");
    }
    put_ok(
        &s.api,
        &format!("/permissions/%2F/{}", s.user),
        json!({"configure": "^c-", "write": "^w-|^amq\\.default$", "read": "^r-"}),
    );
    let (got, v) = s.call("POST", &format!("/queues/%2F/{r}/move"), body.as_deref());
    assert_eq!((got, v), (200, Some(json!({"moved": 0}))));
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
