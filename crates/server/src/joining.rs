//! `warren ctl join_cluster`: a node running on its own becomes a node of a running cluster,
//! as RabbitMQ's `rabbitmqctl stop_app; reset; join_cluster; start_app` makes one.
//!
//! The management API takes the request ([`crate::http`]'s `POST /api/cluster/join`), checks
//! it, and saves the node's cluster settings in its data directory ([`Saved`], in
//! [`FILE`]), marked to be reset. The node then stops as on SIGTERM (its clients are closed
//! with 320, as RabbitMQ's `stop_app` closes them) and starts again in the same process
//! ([`restart`]): the start empties the data directory ([`reset_if_asked`]) and, with no
//! `--cluster-node` of its own, takes the saved settings with `--cluster-join`, so it asks the
//! cluster to add it. Every later start finds the settings there too: the node stays a node
//! of the cluster, as a RabbitMQ node remembers its cluster, without new flags.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The file in the data directory that holds the settings `join_cluster` saved.
pub const FILE: &str = "cluster.json";

/// A node's cluster settings as `join_cluster` saved them: what `--cluster-node`,
/// `--cluster-nodes`, `--cluster-secret-file` and `--cluster-tls-*` would give.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    pub node: u64,
    /// `1=host:port,4=host:port`: this node and the running nodes it asks.
    pub nodes: String,
    pub secret_file: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// The data directory is to be emptied at the next start, before the store opens.
    #[serde(default)]
    pub reset: bool,
}

impl Saved {
    /// The settings saved in `dir`, if any.
    pub fn read(dir: &Path) -> Result<Option<Saved>, String> {
        let path = dir.join(FILE);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        serde_json::from_slice(&text).map(Some).map_err(|e| {
            format!(
                "{} is not the cluster settings warren ctl join_cluster writes ({e}): fix it, \
                 or remove it to start the node on its own",
                path.display()
            )
        })
    }

    /// Saves the settings in `dir` for good: written beside, synced, renamed into place.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let path = dir.join(FILE);
        let tmp = dir.join(format!("{FILE}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&text)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    }
}

/// Whether `name`, an entry of a data directory, is one Warren made: the store's RocksDB
/// files, the replicated queues' logs and snapshots (`raft`) and their messages kept away
/// from memory (`away`). Anything else a user put there (a secret, a certificate, logs) is
/// left alone by a reset.
fn made_by_warren(name: &str) -> bool {
    let numbered = |ext: &str| {
        name.strip_suffix(ext)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    matches!(
        name,
        "CURRENT" | "IDENTITY" | "LOCK" | "LOG" | "away" | "raft" | "warren.lock"
    ) || name.starts_with("LOG.old.")
        || name.starts_with("MANIFEST-")
        || name.starts_with("OPTIONS-")
        || [".sst", ".log", ".blob", ".dbtmp"]
            .into_iter()
            .any(numbered)
}

/// Empties the data directory when the saved settings ask for it (a node that is joining a
/// cluster starts from nothing, as `rabbitmqctl reset` leaves a node), then clears the mark.
/// Killed half way, the next start does it again. Refuses a directory another process holds.
pub fn reset_if_asked(dir: &Path) -> Result<bool, String> {
    let Some(mut saved) = Saved::read(dir)? else {
        return Ok(false);
    };
    if !saved.reset {
        return Ok(false);
    }
    let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", dir.display());
    let lock_path = dir.join("warren.lock");
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| io("cannot open the lock of", e))?;
    if lock.try_lock().is_err() {
        return Err(format!(
            "{} is used by another warren process: stop it first",
            dir.display()
        ));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| io("cannot list", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io("cannot list", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == "warren.lock" || !made_by_warren(name) {
            continue;
        }
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| io("cannot list", e))?;
        let removed = if kind.is_dir() {
            std::fs::remove_dir_all(&path)
        } else if kind.is_symlink() && path.is_dir() {
            // A directory put on another volume through a link: emptied, the link kept.
            empty_dir(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
    }
    saved.reset = false;
    saved
        .write(dir)
        .map_err(|e| io("cannot save the cluster settings in", e))?;
    drop(lock);
    Ok(true)
}

/// Removes everything in `dir`, keeping `dir`.
fn empty_dir(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Lets the management API stop the node so that it starts again in the same process.
pub struct Restart {
    stop: Arc<watch::Sender<bool>>,
    asked: AtomicBool,
    force: AtomicBool,
    signalled: AtomicBool,
}

impl Restart {
    pub fn new(stop: Arc<watch::Sender<bool>>) -> Self {
        Restart {
            stop,
            asked: AtomicBool::new(false),
            force: AtomicBool::new(false),
            signalled: AtomicBool::new(false),
        }
    }

    /// Claims the restart: false when one was claimed already.
    pub fn claim(&self, force: bool) -> bool {
        if self.asked.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.force.store(force, Ordering::SeqCst);
        true
    }

    /// Gives a claim back (its settings could not be saved).
    pub fn unclaim(&self) {
        self.asked.store(false, Ordering::SeqCst);
    }

    /// Stops the node once `after` has passed (the answer to the request on its way).
    pub fn stop_after(&self, after: std::time::Duration) {
        let stop = self.stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = stop.send(true);
        });
    }

    /// A stop signal came: it stops the node for good, a restart asked or not (the saved
    /// settings then wait for the next start).
    pub fn signalled(&self) {
        self.signalled.store(true, Ordering::SeqCst);
        let _ = self.stop.send(true);
    }

    /// Whether the node is to start again, and whether messages it holds may be dropped.
    pub fn wanted(&self) -> Option<bool> {
        (self.asked.load(Ordering::SeqCst) && !self.signalled.load(Ordering::SeqCst))
            .then(|| self.force.load(Ordering::SeqCst))
    }
}

/// The node stopped to join, but held messages when it stopped (some came after the request
/// was checked) and may not drop them: the settings are removed, and it starts again on its
/// own, its messages kept.
pub fn call_off(dir: &Path) -> std::io::Result<()> {
    std::fs::remove_file(dir.join(FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

/// Replaces this process with a new run of the same program (the one running, even if its
/// file was replaced since) and arguments; returns only on failure.
pub fn restart() -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let exe = std::path::Path::new("/proc/self/exe");
    let program = if exe.exists() {
        exe.to_path_buf()
    } else {
        match std::env::args_os().next() {
            Some(a) => PathBuf::from(a),
            None => return std::io::Error::other("no program path"),
        }
    };
    std::process::Command::new(program)
        .args(std::env::args_os().skip(1))
        .exec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved() -> Saved {
        Saved {
            node: 4,
            nodes: "1=127.0.0.1:25701,4=127.0.0.1:25704".into(),
            secret_file: "/etc/warren/cluster.secret".into(),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            reset: true,
        }
    }

    #[test]
    fn a_reset_removes_what_warren_made_and_keeps_the_rest_and_the_settings() {
        let dir = std::env::temp_dir().join(format!("warren-reset-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("raft/snapshots")).expect("dirs");
        // `away` on another volume, through a link: emptied there, the link kept.
        let elsewhere = dir.with_extension("away-volume");
        let _ = std::fs::remove_dir_all(&elsewhere);
        std::fs::create_dir_all(&elsewhere).expect("dirs");
        std::os::unix::fs::symlink(&elsewhere, dir.join("away")).expect("link");
        let ours = [
            "CURRENT",
            "IDENTITY",
            "LOCK",
            "LOG",
            "LOG.old.1764000000",
            "MANIFEST-000005",
            "OPTIONS-000009",
            "000004.log",
            "000012.sst",
            "000013.blob",
            "raft/snapshots/7.snap",
            "away/00000001.seg",
        ];
        let theirs = ["cluster.secret", "warren.log", "notes.sst.txt", "my.log"];
        for f in ours.iter().chain(&theirs) {
            std::fs::write(dir.join(f), b"x").expect("file");
        }
        saved().write(&dir).expect("saved");

        assert_eq!(reset_if_asked(&dir), Ok(true));
        for f in ours {
            assert!(!dir.join(f).exists(), "{f} is Warren's: removed");
        }
        assert!(!dir.join("raft").exists());
        assert!(dir.join("away").is_symlink(), "the link is kept");
        assert_eq!(
            std::fs::read_dir(&elsewhere).expect("the volume").count(),
            0,
            "what it pointed at is emptied"
        );
        for f in theirs {
            assert!(dir.join(f).exists(), "{f} is not Warren's: kept");
        }
        let after = Saved::read(&dir).expect("readable").expect("kept");
        assert_eq!(
            after,
            Saved {
                reset: false,
                ..saved()
            }
        );
        // Done once: the next start keeps what it finds.
        std::fs::write(dir.join("CURRENT"), b"x").expect("file");
        assert_eq!(reset_if_asked(&dir), Ok(false));
        assert!(dir.join("CURRENT").exists());
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }

    #[test]
    fn a_directory_held_by_a_running_node_is_not_reset() {
        let dir = std::env::temp_dir().join(format!("warren-reset-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        saved().write(&dir).expect("saved");
        std::fs::write(dir.join("CURRENT"), b"x").expect("file");
        let held = std::fs::File::create(dir.join("warren.lock")).expect("lock");
        held.lock().expect("locked");
        let refused = reset_if_asked(&dir).expect_err("held");
        assert!(refused.contains("another warren process"), "{refused}");
        assert!(dir.join("CURRENT").exists());
        drop(held);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn settings_that_are_not_json_say_what_to_do() {
        let dir = std::env::temp_dir().join(format!("warren-saved-bad-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        assert_eq!(Saved::read(&dir), Ok(None));
        std::fs::write(dir.join(FILE), b"node = 4").expect("file");
        let e = Saved::read(&dir).expect_err("not json");
        assert!(e.contains("remove it to start the node on its own"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
