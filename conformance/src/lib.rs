//! Black-box conformance harness for Warren.
//!
//! Every test in `tests/` talks to a real broker over TCP:
//!
//! * if `WARREN_TEST_URL` is set (for example `amqp://guest:guest@127.0.0.1:5672/%2f`), that external broker
//!   is used: this is how the suite is checked against RabbitMQ itself;
//! * otherwise each [`TestBroker`] spawns the `warren` binary on a free loopback port and kills it on drop.
//!   The broker records every command applied to its queues (`--record-commands`); on drop the log is
//!   replayed into fresh queue machines and every recorded digest must match, so the whole suite also
//!   checks that queues are rebuilt exactly from their commands (`WARREN_TEST_RECORD=0` turns it off).
//!
//! Two clients are available: [lapin](https://docs.rs/lapin) (what Rust applications use) and [`raw::Raw`], a
//! small socket-level client built on `amq-protocol` that can see everything lapin hides (class and method ids
//! of a close, frame sizes, heartbeats) and can send malformed input.

pub mod cluster;
pub mod disk;
pub mod http;
pub mod partition;
pub mod queues;
pub mod rabbitmq;
pub mod raw;
pub(crate) mod watchdog;

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use lapin;

use lapin::{Connection, ConnectionProperties};

/// How long a test waits for something that must happen. Only reached when a test is failing.
pub const WAIT: Duration = Duration::from_secs(10);
/// How long a test watches for something that must NOT happen.
pub const QUIET: Duration = Duration::from_millis(300);

/// A broker under test: either a spawned `warren` process or the external broker of `WARREN_TEST_URL`.
pub struct TestBroker {
    url: String,
    addr: SocketAddr,
    vhost_path: String,
    child: Option<Child>,
    /// The child's entry in the test binary's [`watchdog`].
    watch: Option<u64>,
    output: Arc<Mutex<Vec<u8>>>,
    /// The command log the spawned broker writes, replayed on drop.
    command_log: Option<PathBuf>,
    /// The spawned broker's data directory (a fresh one per test unless the test gives
    /// `--data-dir`), removed on drop when the harness made it.
    data_dir: Option<PathBuf>,
    owns_data_dir: bool,
    extra_args: Vec<String>,
    /// The management API's and metrics' base URLs (`http://127.0.0.1:PORT`).
    http_url: Option<String>,
    metrics_url: Option<String>,
    /// The SQS API's base URL (`http://127.0.0.1:PORT`).
    sqs_url: Option<String>,
}

impl TestBroker {
    /// Starts a broker with default settings (or uses `WARREN_TEST_URL`).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts `warren --bind 127.0.0.1 --port <free> <extra_args...>`, or uses `WARREN_TEST_URL` (in which case
    /// the extra arguments are ignored: check [`TestBroker::is_external`] when a test depends on them).
    pub fn start_with(extra_args: &[&str]) -> Self {
        if let Some(url) = external_url() {
            let (addr, vhost_path) = parse_url(&url);
            return TestBroker {
                url,
                addr,
                vhost_path,
                child: None,
                watch: None,
                output: Arc::new(Mutex::new(Vec::new())),
                command_log: None,
                data_dir: None,
                owns_data_dir: false,
                extra_args: Vec::new(),
                http_url: Some(
                    std::env::var("WARREN_TEST_HTTP_URL")
                        .unwrap_or_else(|_| "http://127.0.0.1:15672".into()),
                ),
                metrics_url: Some(
                    std::env::var("WARREN_TEST_METRICS_URL")
                        .unwrap_or_else(|_| "http://127.0.0.1:15692".into()),
                ),
                sqs_url: Some(
                    std::env::var("WARREN_TEST_SQS_URL")
                        .unwrap_or_else(|_| "http://127.0.0.1:9324".into()),
                ),
            };
        }
        let bin = warren_binary();
        let given_dir = extra_args.contains(&"--data-dir");
        let data_dir = (!given_dir).then(|| {
            std::env::temp_dir().join(format!(
                "warren-test-data-{}-{}",
                std::process::id(),
                LOG_COUNTER.fetch_add(1, Ordering::Relaxed)
            ))
        });
        // A port can be taken between our check and warren's bind (by another test process on the machine):
        // warren then exits at once, and we try another port.
        let mut last_output = String::new();
        for _attempt in 0..5 {
            let port = free_port();
            if let Some(d) = &data_dir {
                let _ = std::fs::remove_dir_all(d);
            }
            let mut broker = Self::spawn(&bin, port, extra_args, data_dir.as_deref());
            match broker.wait_until_listening() {
                Ok(()) => return broker,
                Err(output) => last_output = output,
            }
        }
        panic!(
            "warren exited before accepting connections, 5 times; its last output:\n{last_output}"
        );
    }

    fn spawn(
        bin: &std::path::Path,
        port: u16,
        extra_args: &[&str],
        data_dir: Option<&std::path::Path>,
    ) -> TestBroker {
        let mut cmd = Command::new(bin);
        if let Some(d) = data_dir {
            cmd.arg("--data-dir").arg(d);
        }
        let command_log = recording().then(|| {
            std::env::temp_dir().join(format!(
                "warren-commands-{}-{port}-{}.log",
                std::process::id(),
                LOG_COUNTER.fetch_add(1, Ordering::Relaxed)
            ))
        });
        if let Some(path) = &command_log {
            let _ = std::fs::remove_file(path);
            cmd.arg("--record-commands").arg(path);
        }
        // The management API and metrics on free ports of their own (tests run side by side),
        // unless the test chose.
        let chosen = |flag: &str| extra_args.iter().any(|a| a.starts_with(flag));
        let mut http_url = None;
        let mut metrics_url = None;
        if !chosen("--no-management") && !chosen("--management-port") {
            let p = free_port();
            cmd.arg("--management-port").arg(p.to_string());
            http_url = Some(format!("http://127.0.0.1:{p}"));
        }
        if !chosen("--no-prometheus") && !chosen("--prometheus-port") {
            let p = free_port();
            cmd.arg("--prometheus-port").arg(p.to_string());
            metrics_url = Some(format!("http://127.0.0.1:{p}"));
        }
        let mut sqs_url = None;
        if !chosen("--no-sqs") && !chosen("--sqs-port") {
            let p = free_port();
            cmd.arg("--sqs-port").arg(p.to_string());
            sqs_url = Some(format!("http://127.0.0.1:{p}"));
        }
        cmd.arg("--bind")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(port.to_string())
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let output = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let sink = output.clone();
            let mut file = std::env::var("WARREN_TEST_NODE_LOGS").ok().and_then(|d| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(std::path::Path::new(&d).join(format!("{port}.log")))
                    .ok()
            });
            std::thread::spawn(move || {
                let mut pipe = pipe;
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Some(f) = file.as_mut() {
                        use std::io::Write;
                        let _ = f.write_all(&buf[..n]);
                        continue;
                    }
                    sink.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
        let pid = child.id();
        let watch = watchdog::started(
            format!("the broker at 127.0.0.1:{port}"),
            Some(output.clone()),
            Box::new(move || watchdog::kill_child(pid)),
        );
        TestBroker {
            url: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            addr: ([127, 0, 0, 1], port).into(),
            vhost_path: "%2f".into(),
            child: Some(child),
            watch: Some(watch),
            output,
            command_log,
            data_dir: data_dir.map(|d| d.to_path_buf()),
            owns_data_dir: data_dir.is_some(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            http_url,
            metrics_url,
            sqs_url,
        }
    }

    /// Stops the spawned broker (SIGKILL if `kill`, else SIGTERM and a wait for its exit),
    /// checks its command log, and starts it again on the same port and data directory.
    pub fn restart(&mut self, kill: bool) {
        self.stop(kill);
        self.start_again();
    }

    /// Stops the spawned broker: SIGKILL (as a crash) if `kill`, else SIGTERM; waits for its
    /// exit and checks its command log. [`TestBroker::start_again`] brings it back.
    pub fn stop(&mut self, kill: bool) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if kill {
            let _ = child.kill();
        } else {
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let _ = child.wait();
        if let Some(w) = self.watch.take() {
            watchdog::stopped(w);
        }
        self.check_command_log();
    }

    /// Starts a stopped broker again, on the same port and data directory.
    pub fn start_again(&mut self) {
        self.start_again_with(&[]);
    }

    /// [`TestBroker::start_again`] with `more` arguments for this start only.
    pub fn start_again_with(&mut self, more: &[&str]) {
        assert!(self.child.is_none(), "start_again needs a stopped broker");
        let port = self.addr.port();
        let mut args: Vec<&str> = self.extra_args.iter().map(String::as_str).collect();
        args.extend_from_slice(more);
        let bin = warren_binary();
        let mut last_output = String::new();
        for _attempt in 0..5 {
            let mut next = Self::spawn(&bin, port, &args, self.data_dir.as_deref());
            next.owns_data_dir = std::mem::take(&mut self.owns_data_dir);
            match next.wait_until_listening() {
                Ok(()) => {
                    // `more` was for this start only.
                    next.extra_args = self.extra_args.clone();
                    // The old value's drop has nothing left to do (no child, no log, no dir).
                    *self = next;
                    return;
                }
                Err(output) => {
                    self.owns_data_dir = std::mem::take(&mut next.owns_data_dir);
                    last_output = output;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        panic!("warren did not restart on port {port}; its last output:\n{last_output}");
    }

    /// The spawned broker's data directory.
    pub fn data_dir(&self) -> Option<&std::path::Path> {
        self.data_dir.as_deref()
    }

    /// Replays the spawned broker's command log (after it exited): every recorded digest of every
    /// queue must come out the same. Panics on a divergence, keeping the log for inspection.
    fn check_command_log(&mut self) {
        let Some(path) = self.command_log.take() else {
            return;
        };
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            // The broker never started (a port race): nothing to check.
            Err(_) => return,
        };
        match warren_broker::queue::log::replay(bytes::Bytes::from(data)) {
            Ok(_) => {
                let _ = std::fs::remove_file(&path);
            }
            Err(e) if !std::thread::panicking() => panic!(
                "replaying the broker's command log {} does not rebuild its queues: {e}",
                path.display()
            ),
            Err(e) => eprintln!("command log {}: {e}", path.display()),
        }
    }

    /// Ok once the spawned broker accepts connections; Err(output) if it exited first. Panics after 10 s.
    fn wait_until_listening(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(_status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                std::thread::sleep(Duration::from_millis(20));
                return Err(self.output());
            }
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(100)).is_ok() {
                // Make sure it is our process that answered, not another broker on a reused
                // port that goes away meanwhile (a test's broker being dropped): ours says it
                // bound the port. A broker told to log less says nothing: alive after a
                // moment is taken as ours.
                let said = Instant::now();
                while said.elapsed() < Duration::from_millis(300)
                    && !self.output().contains("listening for AMQP")
                {
                    std::thread::sleep(Duration::from_millis(5));
                    if self
                        .child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten())
                        .is_some()
                    {
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
                if let Some(_status) = self
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                {
                    std::thread::sleep(Duration::from_millis(20));
                    return Err(self.output());
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                panic!(
                    "warren did not accept connections on {} within 10 s; its output:\n{}",
                    self.addr,
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `amqp://guest:guest@host:port/%2f`
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL with other credentials.
    pub fn url_with_credentials(&self, user: &str, password: &str) -> String {
        format!("amqp://{user}:{password}@{}/{}", self.addr, self.vhost_path)
    }

    /// The URL for another virtual host (percent-encoded by the caller).
    pub fn url_with_vhost(&self, vhost_path: &str) -> String {
        format!("amqp://guest:guest@{}/{vhost_path}", self.addr)
    }

    /// The management API's base URL, `http://127.0.0.1:PORT` (`WARREN_TEST_HTTP_URL`, by
    /// default `http://127.0.0.1:15672`, against an external broker); `None` if turned off.
    pub fn http_url(&self) -> Option<&str> {
        self.http_url.as_deref()
    }

    /// The Prometheus endpoint's base URL (`WARREN_TEST_METRICS_URL` against an external
    /// broker, by default `http://127.0.0.1:15692`).
    /// The SQS API's base URL (`None` when the test turned it off or chose its port).
    pub fn sqs_url(&self) -> Option<&str> {
        self.sqs_url.as_deref()
    }

    pub fn metrics_url(&self) -> Option<&str> {
        self.metrics_url.as_deref()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The spawned broker's process id (`None` against an external broker).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The spawned broker's resident memory in bytes, from /proc (`None` elsewhere).
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// True when the suite runs against `WARREN_TEST_URL` (for example RabbitMQ), not a spawned Warren.
    pub fn is_external(&self) -> bool {
        self.child.is_none()
    }

    /// Everything the spawned broker printed so far.
    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Opens a lapin connection as guest/guest. A failure shows what the broker printed.
    pub async fn connect(&self) -> Connection {
        let url = &self.url;
        match tokio::time::timeout(
            WAIT,
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => panic!(
                "connect to {url} failed: {e:?}; the broker (running: {}) printed:\n{}",
                self.child.is_none() || self.pid().is_some_and(alive),
                self.output()
            ),
            Err(_) => panic!(
                "connect to {url} timed out; the broker printed:\n{}",
                self.output()
            ),
        }
    }

    /// Opens a raw-socket connection, completes the handshake, negotiates no heartbeats.
    pub async fn raw(&self) -> raw::Raw {
        raw::Raw::open(self.addr).await
    }

    /// Sends SIGTERM to the spawned broker. Panics for an external broker.
    pub fn sigterm(&self) {
        let child = self.child.as_ref().expect("sigterm needs a spawned broker");
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed");
    }

    /// Waits for the spawned broker to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("needs a spawned broker");
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
            if let Some(w) = self.watch.take() {
                watchdog::stopped(w);
            }
            self.check_command_log();
            if self.owns_data_dir {
                if let Some(d) = &self.data_dir {
                    let _ = std::fs::remove_dir_all(d);
                }
            }
            if std::thread::panicking() {
                // Let the pipe readers drain what is left.
                std::thread::sleep(Duration::from_millis(50));
                eprintln!(
                    "---- warren output ({}) ----\n{}\n---- end of warren output ----",
                    self.addr,
                    self.output()
                );
            }
        }
    }
}

static LOG_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Spawned brokers record their queue commands unless `WARREN_TEST_RECORD=0`.
fn recording() -> bool {
    std::env::var("WARREN_TEST_RECORD").map_or(true, |v| v.trim() != "0")
}

fn external_url() -> Option<String> {
    std::env::var("WARREN_TEST_URL")
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// Splits `amqp://user:pass@host:port/vhost` into a socket address and the vhost path segment.
fn parse_url(url: &str) -> (SocketAddr, String) {
    let rest = url
        .strip_prefix("amqp://")
        .unwrap_or_else(|| panic!("WARREN_TEST_URL must start with amqp://, got {url}"));
    let rest = rest.rsplit_once('@').map(|(_, r)| r).unwrap_or(rest);
    let (hostport, vhost) = rest.split_once('/').unwrap_or((rest, "%2f"));
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5672")
    };
    let addr = hostport
        .to_socket_addrs()
        .unwrap_or_else(|e| panic!("cannot resolve {hostport}: {e}"))
        .next()
        .expect("no address");
    let vhost = if vhost.is_empty() { "%2f" } else { vhost };
    (addr, vhost.to_string())
}

/// This crate's folder: as `cargo test` says when it runs the test, else where it was built.
/// (A test binary that cargo reused from a build of the same sources in another checkout, with
/// the same target folder, names that checkout's folder in its compile-time value.)
pub fn conformance_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The `warren` binary: `WARREN_BIN`, else `target/<profile>/warren` next to the test executable.
pub fn warren_binary() -> PathBuf {
    if let Ok(bin) = std::env::var("WARREN_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/warren
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join(format!("warren{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        panic!(
            "the warren binary is missing at {} — build it first (cargo build -p warren-server), \
             set WARREN_BIN, or set WARREN_TEST_URL to test an external broker",
            bin.display()
        );
    }
    bin
}

/// A free loopback port below the kernel's ephemeral range (so outgoing connections never take it), spread by
/// process id so that concurrent test processes on one machine start in different places.
/// A loopback port free now (each call a different one).
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    const LOW: u64 = 20_000;
    const SPAN: u64 = 12_000;
    let start = (std::process::id() as u64 * 7919) % SPAN;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (start + n) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Whether a process of this id runs (and is not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A name no other test (nor another run against a shared broker) uses: `<prefix>-<pid>-<n>-<nanos>`.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{:x}-{n}-{nanos:x}", std::process::id())
}

/// Opens a lapin connection to `url`, failing the test after [`WAIT`].
pub async fn connect_url(url: &str) -> Connection {
    tokio::time::timeout(
        WAIT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .unwrap_or_else(|_| panic!("connect to {url} timed out"))
    .unwrap_or_else(|e| panic!("connect to {url} failed: {e:?}"))
}

/// Awaits `fut`, failing the test with `what` after [`WAIT`].
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    within_for(WAIT, what, fut).await
}

/// [`within`] with a deadline of its own, for a step whose length is set by a volume of data
/// (and so by how busy the machine is), not by a protocol timer.
pub async fn within_for<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// The reply code and text of a lapin error that carries a channel.close or connection.close.
pub fn amqp_error(err: &lapin::Error) -> Option<(u16, String)> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some((e.get_id(), e.get_message().to_string())),
        _ => None,
    }
}

/// Asserts that a lapin result failed with a broker error of this reply code and exact reply text.
#[track_caller]
pub fn assert_amqp_error<T: std::fmt::Debug>(res: lapin::Result<T>, code: u16, text: &str) {
    match res {
        Ok(v) => panic!("expected error {code} {text:?}, got Ok({v:?})"),
        Err(e) => match amqp_error(&e) {
            Some((c, t)) => {
                assert_eq!((c, t.as_str()), (code, text), "wrong error (full: {e:?})")
            }
            None => panic!("expected AMQP error {code} {text:?}, got {e:?}"),
        },
    }
}
