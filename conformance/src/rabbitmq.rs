//! A RabbitMQ node of its own for a test (Debian's `rabbitmq-server`, with the management and
//! shovel plugins): free ports, a fresh data directory, killed with its process group on drop.
//! Tests that need one are skipped where RabbitMQ is not installed, unless
//! `WARREN_TEST_REQUIRE_RABBITMQ=1` (which `scripts/test` sets once it installed it).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

pub struct RabbitMq {
    child: Child,
    /// Its entry in the test binary's watchdog.
    watch: u64,
    dir: PathBuf,
    pub amqp_port: u16,
    pub http_port: u16,
}

/// How long a node may take to boot on a busy two-core machine.
const BOOT: Duration = Duration::from_secs(90);

impl RabbitMq {
    /// A running node, or `None` (with a line saying why) where RabbitMQ is not installed.
    pub fn start() -> Option<RabbitMq> {
        let installed = Command::new("sh")
            .args(["-c", "command -v rabbitmq-server"])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        // Debian's script runs only as root (it starts the node as the rabbitmq user).
        let root = unsafe { libc::geteuid() } == 0;
        if installed && !root {
            assert!(
                std::env::var("WARREN_TEST_REQUIRE_RABBITMQ").as_deref() != Ok("1"),
                "WARREN_TEST_REQUIRE_RABBITMQ=1 but the test runs as a user who cannot start                  Debian's rabbitmq-server (it needs root)"
            );
            eprintln!("skipped: starting Debian's rabbitmq-server needs root");
            return None;
        }
        if !installed {
            assert!(
                std::env::var("WARREN_TEST_REQUIRE_RABBITMQ").as_deref() != Ok("1"),
                "WARREN_TEST_REQUIRE_RABBITMQ=1 but rabbitmq-server is not installed \
                 (Debian: apt-get install rabbitmq-server; scripts/test installs it)"
            );
            eprintln!(
                "skipped: rabbitmq-server is not installed (apt-get install rabbitmq-server)"
            );
            return None;
        }
        let (amqp_port, http_port, dist_port) = (free_port(), free_port(), free_port());
        let name = crate::unique("warren-test");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(dir.join("mnesia")).expect("data dir");
        std::fs::create_dir_all(dir.join("log")).expect("log dir");
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = {amqp_port}\nmanagement.tcp.port = {http_port}\n\
                 loopback_users = none\nlog.console = false\n"
            ),
        )
        .expect("config");
        std::fs::write(
            dir.join("enabled_plugins"),
            "[rabbitmq_management,rabbitmq_shovel,rabbitmq_shovel_management].\n",
        )
        .expect("plugins");
        // Run as root, Debian's script starts the node as the rabbitmq user: its files must be
        // that user's.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status();
        let mut cmd = Command::new("rabbitmq-server");
        cmd.env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env(
                "RABBITMQ_NODENAME",
                format!("{}@localhost", name.replace('-', "_")),
            )
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().expect("spawn rabbitmq-server");
        let (pgid, marker) = (child.id(), dir.to_string_lossy().into_owned());
        let watch = crate::watchdog::started(
            format!("RabbitMQ {name}"),
            None,
            Box::new(move || kill_node(pgid, &marker)),
        );
        let node = RabbitMq {
            child,
            watch,
            dir,
            amqp_port,
            http_port,
        };
        let started = Instant::now();
        loop {
            let ok = std::net::TcpStream::connect(("127.0.0.1", http_port)).is_ok()
                && crate::http::request(
                    "GET",
                    &format!("{}/api/overview", node.http_url()),
                    Some(("guest", "guest")),
                    &[],
                    None,
                )
                .status
                    == 200;
            if ok {
                return Some(node);
            }
            assert!(
                started.elapsed() < BOOT,
                "RabbitMQ did not start within {BOOT:?}; its logs are in {}",
                node.dir.join("log").display()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    pub fn http_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// The AMQP URL of vhost `/` as guest.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// `method` on `/api{path}` as guest: the status and the JSON body (`Null` if none).
    pub fn api(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let r = crate::http::request(
            method,
            &format!("{}/api{path}", self.http_url()),
            Some(("guest", "guest")),
            &[],
            body.map(|b| b.to_string()).as_deref(),
        );
        let v = serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null);
        (r.status, v)
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        kill_node(self.child.id(), &self.dir.to_string_lossy());
        let _ = self.child.wait();
        crate::watchdog::stopped(self.watch);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Kills a node started in process group `pgid` with its data in `dir`. The script starts
/// the node through `su`, in a session of its own: the processes to kill are found by the
/// data directory in their environment.
fn kill_node(pgid: u32, dir: &str) {
    unsafe { libc::kill(-(pgid as libc::pid_t), libc::SIGKILL) };
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let env = std::fs::read(p.path().join("environ")).unwrap_or_default();
            if String::from_utf8_lossy(&env).contains(dir) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}
