//! `warren-sqs-bench`: load on an SQS endpoint (Warren's, or any other that takes SigV4-signed
//! JSON-protocol requests), in the shapes the SQS issue measures: one client sending and one
//! receiving, ElasticMQ's published shape (20 and 40 threads each sending, receiving and
//! deleting one message at a time), 32 long-pollers fed by batch senders, the wake-up latency of
//! a long poll, and 1,000 idle long-pollers. Blocking HTTP (ureq) on threads, one connection per
//! thread, kept alive: the client stays cheap next to the broker on a 2-core machine.

#[allow(dead_code)]
#[path = "stats.rs"]
mod stats;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "warren-sqs-bench",
    about = "Load on an SQS endpoint, as the SQS issue measures it"
)]
struct Opts {
    /// The SQS endpoint.
    #[arg(long, default_value = "http://127.0.0.1:9324")]
    endpoint: String,
    /// Access key id and secret (a Warren user's name and password work).
    #[arg(long, default_value = "guest")]
    key: String,
    #[arg(long, default_value = "guest")]
    secret: String,
    /// The broker's process id: its CPU time and memory go in the report.
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Seconds each timed scenario runs.
    #[arg(long, default_value_t = 10.0)]
    secs: f64,
    /// Scenarios, in order: single, elasticmq, pollers, wakeup, idle.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "single,elasticmq,pollers,wakeup,idle"
    )]
    scenarios: Vec<String>,
    /// Idle long-pollers in the `idle` scenario.
    #[arg(long, default_value_t = 1000)]
    idle_pollers: usize,
    /// Wake-ups measured in the `wakeup` scenario.
    #[arg(long, default_value_t = 200)]
    wakeups: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One client: a kept-alive connection and a signer.
struct Client {
    agent: ureq::Agent,
    endpoint: String,
    host: String,
    key: String,
    secret: String,
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(key) else {
        return Vec::new();
    };
    m.update(data.as_bytes());
    m.finalize().into_bytes().to_vec()
}

/// `YYYYMMDDTHHMMSSZ` for a Unix time (civil date from days, Howard Hinnant's algorithm).
fn amz_date(unix: u64) -> String {
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

impl Client {
    fn new(o: &Opts) -> Client {
        // Timeouts per step, none on the name lookup: with a global timeout ureq resolves
        // every request's host on a thread of its own (a thread per request), which cost
        // this load generator more CPU than the broker it measures.
        let wait = Some(Duration::from_secs(40));
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_send_request(wait)
            .timeout_send_body(wait)
            .timeout_recv_response(wait)
            .timeout_recv_body(wait)
            .proxy(None)
            .build();
        Client {
            agent: ureq::Agent::new_with_config(config),
            endpoint: o.endpoint.trim_end_matches('/').to_owned(),
            host: o
                .endpoint
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_owned(),
            key: o.key.clone(),
            secret: o.secret.clone(),
        }
    }

    /// One action with its JSON input; the JSON answer, or the error SQS gave.
    fn call(&self, action: &str, input: &Value) -> Result<Value, BoxError> {
        let body = input.to_string();
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let date = amz_date(unix);
        let target = format!("AmazonSQS.{action}");
        let ctype = "application/x-amz-json-1.0";
        let signed = "content-type;host;x-amz-date;x-amz-target";
        let canonical = format!(
            "POST\n/\n\ncontent-type:{ctype}\nhost:{}\nx-amz-date:{date}\nx-amz-target:{target}\n\n{signed}\n{}",
            self.host,
            hex::encode(Sha256::digest(body.as_bytes()))
        );
        let scope = format!("{}/us-east-1/sqs/aws4_request", &date[..8]);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{date}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let mut k = hmac(format!("AWS4{}", self.secret).as_bytes(), &date[..8]);
        for part in ["us-east-1", "sqs", "aws4_request"] {
            k = hmac(&k, part);
        }
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={}",
            self.key,
            hex::encode(hmac(&k, &to_sign))
        );
        let mut resp = self
            .agent
            .post(&format!("{}/", self.endpoint))
            .header("content-type", ctype)
            .header("x-amz-date", &date)
            .header("x-amz-target", &target)
            .header("authorization", &auth)
            .send(body.as_bytes())?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string()?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status == 200 {
            Ok(v)
        } else {
            Err(format!("{action}: {status} {text}").into())
        }
    }

    fn queue(&self, name: &str) -> Result<String, BoxError> {
        let v = self.call("CreateQueue", &json!({"QueueName": name}))?;
        v["QueueUrl"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| "CreateQueue gave no QueueUrl".into())
    }

    fn send(&self, url: &str, body: &str) -> Result<(), BoxError> {
        self.call(
            "SendMessage",
            &json!({"QueueUrl": url, "MessageBody": body}),
        )
        .map(|_| ())
    }

    fn send_batch(&self, url: &str, n: usize) -> Result<(), BoxError> {
        let entries: Vec<Value> = (0..n)
            .map(|i| json!({"Id": i.to_string(), "MessageBody": "0123456789abcdef"}))
            .collect();
        self.call(
            "SendMessageBatch",
            &json!({"QueueUrl": url, "Entries": entries}),
        )
        .map(|_| ())
    }

    /// Receives up to `max` and deletes them (one DeleteMessage, or a batch); how many.
    fn receive_delete(&self, url: &str, max: u32, wait: u32) -> Result<usize, BoxError> {
        let v = self.call(
            "ReceiveMessage",
            &json!({"QueueUrl": url, "MaxNumberOfMessages": max, "WaitTimeSeconds": wait}),
        )?;
        let msgs = v["Messages"].as_array().cloned().unwrap_or_default();
        match msgs.as_slice() {
            [] => {}
            [m] => {
                self.call(
                    "DeleteMessage",
                    &json!({"QueueUrl": url, "ReceiptHandle": m["ReceiptHandle"]}),
                )?;
            }
            many => {
                let entries: Vec<Value> = many
                    .iter()
                    .enumerate()
                    .map(|(i, m)| json!({"Id": i.to_string(), "ReceiptHandle": m["ReceiptHandle"]}))
                    .collect();
                self.call(
                    "DeleteMessageBatch",
                    &json!({"QueueUrl": url, "Entries": entries}),
                )?;
            }
        }
        Ok(msgs.len())
    }
}

/// The broker's CPU seconds and RSS (kB) now, if its pid was given.
fn broker(o: &Opts) -> Option<stats::ProcSample> {
    o.broker_pid.and_then(|p| stats::sample(p).ok())
}

/// Broker CPU per message (us) between two samples, and the broker's cores used.
fn cpu(
    o: &Opts,
    before: &Option<stats::ProcSample>,
    msgs: u64,
    secs: f64,
) -> (Option<f64>, Option<f64>) {
    match (before, broker(o)) {
        (Some(b), Some(a)) => {
            let cpu = a.cpu_s - b.cpu_s;
            (
                (msgs > 0).then(|| cpu * 1e6 / msgs as f64),
                Some(cpu / secs.max(1e-9)),
            )
        }
        _ => (None, None),
    }
}

fn unique(prefix: &str) -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{n:x}")
}

/// Runs `threads` threads doing `work(client, index, stop)` for `secs`; the sum of what they count.
fn threads(
    o: &Opts,
    n: usize,
    secs: f64,
    work: impl Fn(&Client, usize, &AtomicBool) -> Result<u64, BoxError> + Send + Sync + 'static,
) -> Result<u64, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let work = Arc::new(work);
    let total = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for i in 0..n {
        let (o, stop, work, total) = (o.clone(), stop.clone(), work.clone(), total.clone());
        handles.push(std::thread::spawn(move || -> Result<(), String> {
            let c = Client::new(&o);
            let done = work(&c, i, &stop).map_err(|e| e.to_string())?;
            total.fetch_add(done, Ordering::Relaxed);
            Ok(())
        }));
    }
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().map_err(|_| "a client thread panicked")??;
    }
    Ok(total.load(Ordering::Relaxed))
}

fn single(o: &Opts) -> Result<Value, BoxError> {
    let c = Client::new(o);
    let url = c.queue(&unique("sqs-bench-single"))?;
    let before = broker(o);
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed().as_secs_f64() < o.secs {
        c.send(&url, "0123456789abcdef")?;
        sent += 1;
    }
    let send_secs = start.elapsed().as_secs_f64();
    let (send_cpu, _) = cpu(o, &before, sent, send_secs);
    let before = broker(o);
    let start = Instant::now();
    let mut received = 0u64;
    while received < sent {
        let n = c.receive_delete(&url, 10, 0)?;
        if n == 0 {
            break;
        }
        received += n as u64;
    }
    let recv_secs = start.elapsed().as_secs_f64();
    let (recv_cpu, _) = cpu(o, &before, received, recv_secs);
    c.call("DeleteQueue", &json!({"QueueUrl": url}))?;
    Ok(json!({
        "send_per_s": sent as f64 / send_secs,
        "send_broker_cpu_us_per_msg": send_cpu,
        "receive_delete_per_s": received as f64 / recv_secs,
        "receive_broker_cpu_us_per_msg": recv_cpu,
        "messages": sent,
    }))
}

/// ElasticMQ's published shape: each thread sends a message, receives one, deletes it.
fn elasticmq(o: &Opts, n: usize) -> Result<Value, BoxError> {
    let c = Client::new(o);
    let url = c.queue(&unique("sqs-bench-roundtrip"))?;
    let before = broker(o);
    let start = Instant::now();
    let u = url.clone();
    let done = threads(o, n, o.secs, move |c, _, stop| {
        let mut done = 0;
        while !stop.load(Ordering::Relaxed) {
            c.send(&u, "0123456789abcdef")?;
            done += c.receive_delete(&u, 1, 0)? as u64;
        }
        Ok(done)
    })?;
    let secs = start.elapsed().as_secs_f64();
    let (per_msg, cores) = cpu(o, &before, done, secs);
    c.call("PurgeQueue", &json!({"QueueUrl": url}))?;
    c.call("DeleteQueue", &json!({"QueueUrl": url}))?;
    Ok(json!({
        "threads": n,
        "messages_per_s": done as f64 / secs,
        "broker_cpu_us_per_msg": per_msg,
        "broker_cores": cores,
    }))
}

/// 32 long-pollers receiving and deleting in batches, fed by 4 batch senders.
fn pollers(o: &Opts) -> Result<Value, BoxError> {
    let c = Client::new(o);
    let url = c.queue(&unique("sqs-bench-pollers"))?;
    let sent = Arc::new(AtomicU64::new(0));
    let stop_senders = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for _ in 0..4 {
        let (o, url, sent, stop) = (o.clone(), url.clone(), sent.clone(), stop_senders.clone());
        senders.push(std::thread::spawn(move || -> Result<(), String> {
            let c = Client::new(&o);
            while !stop.load(Ordering::Relaxed) {
                c.send_batch(&url, 10).map_err(|e| e.to_string())?;
                sent.fetch_add(10, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    let before = broker(o);
    let start = Instant::now();
    let u = url.clone();
    let received = threads(o, 32, o.secs, move |c, _, stop| {
        let mut done = 0;
        while !stop.load(Ordering::Relaxed) {
            done += c.receive_delete(&u, 10, 1)? as u64;
        }
        Ok(done)
    })?;
    let secs = start.elapsed().as_secs_f64();
    stop_senders.store(true, Ordering::Relaxed);
    for h in senders {
        h.join().map_err(|_| "a sender panicked")??;
    }
    let (per_msg, cores) = cpu(o, &before, received, secs);
    c.call("PurgeQueue", &json!({"QueueUrl": url}))?;
    c.call("DeleteQueue", &json!({"QueueUrl": url}))?;
    Ok(json!({
        "pollers": 32,
        "senders": 4,
        "sent_per_s": sent.load(Ordering::Relaxed) as f64 / secs,
        "received_per_s": received as f64 / secs,
        "broker_cpu_us_per_msg": per_msg,
        "broker_cores": cores,
    }))
}

/// How long a waiting long poll takes to answer once a message is sent.
fn wakeup(o: &Opts) -> Result<Value, BoxError> {
    let c = Client::new(o);
    let url = c.queue(&unique("sqs-bench-wakeup"))?;
    let mut h = stats::new_histogram();
    let (tx, rx) = std::sync::mpsc::channel::<Instant>();
    let (o2, u) = (o.clone(), url.clone());
    let n = o.wakeups;
    let poller = std::thread::spawn(move || -> Result<(), String> {
        let c = Client::new(&o2);
        let mut got = 0;
        while got < n {
            let k = c.receive_delete(&u, 1, 20).map_err(|e| e.to_string())?;
            if k > 0 {
                got += k;
                tx.send(Instant::now()).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    });
    // From the send's start (what a producer-to-worker hop costs, the send's durable write
    // included), and from the send's answer (the wake-up alone; 0 if the poll answered first).
    let mut after_answer = stats::new_histogram();
    for _ in 0..n {
        // The poll is waiting by now.
        std::thread::sleep(Duration::from_millis(20));
        let sent = Instant::now();
        c.send(&url, "wake up")?;
        let send_answered = Instant::now();
        let answered = rx.recv_timeout(Duration::from_secs(30))?;
        let us = |from: Instant| {
            u64::try_from(answered.saturating_duration_since(from).as_micros()).unwrap_or(u64::MAX)
        };
        h.record(us(sent))?;
        after_answer.record(us(send_answered))?;
    }
    poller.join().map_err(|_| "the poller panicked")??;
    c.call("DeleteQueue", &json!({"QueueUrl": url}))?;
    Ok(json!({
        "wakeups": n,
        "from_send_p50_us": h.value_at_quantile(0.5),
        "from_send_p99_us": h.value_at_quantile(0.99),
        "from_send_max_us": h.max(),
        "after_send_answered_p50_us": after_answer.value_at_quantile(0.5),
        "after_send_answered_p99_us": after_answer.value_at_quantile(0.99),
    }))
}

/// Idle long-pollers on empty queues: what they cost the broker in memory and CPU.
fn idle(o: &Opts) -> Result<Value, BoxError> {
    let c = Client::new(o);
    let urls: Vec<String> = (0..10)
        .map(|i| c.queue(&unique(&format!("sqs-bench-idle-{i}"))))
        .collect::<Result<_, _>>()?;
    let start_rss = broker(o).map(|s| s.rss_kb);
    let urls = Arc::new(urls);
    let u = urls.clone();
    let n = o.idle_pollers;
    // Let the polls settle in before measuring: their connections and waits are set up.
    let settle = 3.0;
    let measured = Arc::new(std::sync::Mutex::new(None));
    let m = measured.clone();
    let o2 = o.clone();
    let timer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs_f64(settle));
        let before = broker(&o2);
        std::thread::sleep(Duration::from_secs_f64(o2.secs));
        let after = broker(&o2);
        if let Ok(mut m) = m.lock() {
            *m = Some((before, after));
        }
    });
    let polls = threads(o, n, settle + o.secs, move |c, i, stop| {
        let mut answered = 0;
        while !stop.load(Ordering::Relaxed) {
            answered += c.receive_delete(&u[i % u.len()], 1, 20)? as u64;
        }
        Ok(answered)
    });
    timer.join().map_err(|_| "the timer panicked")?;
    polls?;
    for url in urls.iter() {
        c.call("DeleteQueue", &json!({"QueueUrl": url}))?;
    }
    let (before, after) = measured
        .lock()
        .ok()
        .and_then(|m| *m)
        .unwrap_or((None, None));
    let per_poller_kb = match (start_rss, &after) {
        (Some(s), Some(a)) => Some((a.rss_kb as f64 - s as f64) / n as f64),
        _ => None,
    };
    let cpu_percent = match (&before, &after) {
        (Some(b), Some(a)) => Some((a.cpu_s - b.cpu_s) * 100.0 / o.secs),
        _ => None,
    };
    Ok(json!({
        "pollers": n,
        "broker_rss_kb_per_poller": per_poller_kb,
        "broker_rss_mb": after.map(|a| a.rss_kb as f64 / 1024.0),
        "broker_cpu_percent_while_idle": cpu_percent,
    }))
}

fn main() {
    let o = Opts::parse();
    let mut report = serde_json::Map::new();
    for s in &o.scenarios {
        let r = match s.as_str() {
            "single" => single(&o),
            "elasticmq" => elasticmq(&o, 20).and_then(|a| {
                let b = elasticmq(&o, 40)?;
                Ok(json!({"20_threads": a, "40_threads": b}))
            }),
            "pollers" => pollers(&o),
            "wakeup" => wakeup(&o),
            "idle" => idle(&o),
            other => Err(format!("unknown scenario {other}").into()),
        };
        match r {
            Ok(v) => {
                eprintln!("{s}: {v}");
                report.insert(s.clone(), v);
            }
            Err(e) => {
                eprintln!("warren-sqs-bench: {s}: {e}");
                std::process::exit(1);
            }
        }
    }
    println!("{}", Value::Object(report));
}
