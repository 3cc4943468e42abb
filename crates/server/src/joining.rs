//! `warren ctl join_cluster`: a node running on its own becomes a node of a running cluster,
//! as RabbitMQ's `rabbitmqctl stop_app; reset; join_cluster; start_app` makes one.
//!
//! The management API takes the request ([`crate::http`]'s `POST /api/cluster/join`), checks
//! it, and saves the node's cluster settings in its data directory as asked for ([`Asked`]).
//! The node then stops as on SIGTERM (its clients are closed with 320, as RabbitMQ's
//! `stop_app` closes them), counts what it still holds once nothing can change it, and only
//! then makes the settings its own ([`Saved`], in [`FILE`], marked to be reset), unless it
//! holds messages it may not drop. It starts again in the same process ([`restart`]): the
//! start empties the data directory ([`reset_if_asked`]) and, with no `--cluster-node` of its
//! own, takes the saved settings with `--cluster-join`, so it asks the cluster to add it. Every later start finds the settings there too: the node stays a node
//! of the cluster, as a RabbitMQ node remembers its cluster, without new flags.

use std::io::Write;
use std::path::{Path, PathBuf};
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
        self.write_as(dir, FILE)
    }

    fn write_as(&self, dir: &Path, name: &str) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let path = dir.join(name);
        let tmp = dir.join(format!("{name}.tmp"));
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
    let Some(lock) = lock_dir(dir).map_err(|e| io("cannot open the lock of", e))? else {
        return Err(format!(
            "{} is used by another warren process: stop it first",
            dir.display()
        ));
    };
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

/// Where the API saves a join's settings until the node has stopped: only then, when what the
/// node held was counted, are they moved to [`FILE`] ([`Asked::confirm`]). A crash before
/// leaves this file alone, which the next start removes ([`drop_interrupted`]): the node
/// starts on its own, its messages kept.
pub const ASKED: &str = "cluster.json.asked";

/// The settings of a join asked for, saved in [`ASKED`].
pub struct Asked;

impl Asked {
    /// Saves `saved` as asked for.
    pub fn save(dir: &Path, saved: &Saved) -> std::io::Result<()> {
        saved.write_as(dir, ASKED)
    }

    /// The node stopped and may be reset: the settings take effect at the next start.
    pub fn confirm(dir: &Path) -> std::io::Result<()> {
        std::fs::rename(dir.join(ASKED), dir.join(FILE))?;
        std::fs::File::open(dir)?.sync_all()
    }

    /// The join is called off: the node keeps what it holds.
    pub fn withdraw(dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(dir.join(ASKED)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::File::open(dir)?.sync_all()
    }
}

/// A join asked for whose node did not stop cleanly (killed, or its stop failed): its
/// messages were not counted, so it is not done; the node starts on its own. Whether one was.
pub fn drop_interrupted(dir: &Path) -> std::io::Result<bool> {
    if !dir.join(ASKED).exists() {
        return Ok(false);
    }
    // Not while the node that asked still runs (this start then fails on the store's lock).
    let Some(_held) = lock_dir(dir)? else {
        return Ok(false);
    };
    Asked::withdraw(dir)?;
    Ok(true)
}

/// The data directory's lock (the store's), held while the guard lives; `None` when another
/// process holds it.
fn lock_dir(dir: &Path) -> std::io::Result<Option<std::fs::File>> {
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("warren.lock"))?;
    Ok(lock.try_lock().is_ok().then_some(lock))
}

/// What the node does once it stopped, as [`Restart`] decides it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// No join was asked for.
    NoJoin,
    /// A join was asked for, and whether held messages may be dropped; and whether a stop
    /// signal came (the node then stops for good, and joins at its next start).
    Join { force: bool, signalled: bool },
}

#[derive(Default)]
struct State {
    asked: Option<bool>,
    signalled: bool,
    decided: bool,
}

/// Lets the management API stop the node so that it starts again in the same process.
pub struct Restart {
    stop: Arc<watch::Sender<bool>>,
    state: std::sync::Mutex<State>,
}

impl Restart {
    pub fn new(stop: Arc<watch::Sender<bool>>) -> Self {
        Restart {
            stop,
            state: std::sync::Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims the join: false when one was claimed already, or the node is stopping.
    pub fn claim(&self, force: bool) -> bool {
        let mut s = self.state();
        if s.asked.is_some() || s.signalled || s.decided || *self.stop.borrow() {
            return false;
        }
        s.asked = Some(force);
        true
    }

    /// Gives a claim back (its settings could not be saved).
    pub fn unclaim(&self) {
        self.state().asked = None;
    }

    /// Stops the node once `after` has passed (the answer to the request on its way).
    pub fn stop_after(&self, after: std::time::Duration) {
        let stop = self.stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = stop.send(true);
        });
    }

    /// A stop signal came: the node stops, and does not start again in this process.
    pub fn signalled(&self) {
        self.state().signalled = true;
        let _ = self.stop.send(true);
    }

    /// What the node does now that it stopped; no join can be claimed after this.
    pub fn decide(&self) -> Outcome {
        let mut s = self.state();
        s.decided = true;
        match s.asked {
            None => Outcome::NoJoin,
            Some(force) => Outcome::Join {
                force,
                signalled: s.signalled,
            },
        }
    }
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
        // Nor is the join the running node asked for taken from it.
        Asked::save(&dir, &saved()).expect("asked");
        assert_eq!(drop_interrupted(&dir).ok(), Some(false));
        assert!(dir.join(ASKED).exists());
        drop(held);
        assert_eq!(drop_interrupted(&dir).ok(), Some(true));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Asked-for settings become the node's only when the stop confirms them; withdrawn, or
    /// left by a node that did not stop cleanly, they are gone at the next start.
    #[test]
    fn asked_settings_become_the_nodes_only_once_confirmed() {
        let dir = std::env::temp_dir().join(format!("warren-asked-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        Asked::save(&dir, &saved()).expect("asked");
        assert_eq!(Saved::read(&dir), Ok(None), "not the node's settings yet");
        assert_eq!(drop_interrupted(&dir).ok(), Some(true));
        assert!(!dir.join(ASKED).exists());
        assert_eq!(drop_interrupted(&dir).ok(), Some(false));

        Asked::save(&dir, &saved()).expect("asked");
        Asked::withdraw(&dir).expect("withdrawn");
        assert_eq!(Saved::read(&dir), Ok(None));

        Asked::save(&dir, &saved()).expect("asked");
        Asked::confirm(&dir).expect("confirmed");
        assert_eq!(Saved::read(&dir), Ok(Some(saved())));
        assert!(!dir.join(ASKED).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_join_is_claimed_once_and_never_once_the_node_stops() {
        let (tx, _rx) = watch::channel(false);
        let r = Restart::new(Arc::new(tx));
        assert!(r.claim(false));
        assert!(!r.claim(true), "one join at a time");
        r.unclaim();
        assert!(r.claim(true));
        assert_eq!(
            r.decide(),
            Outcome::Join {
                force: true,
                signalled: false
            }
        );
        assert!(!r.claim(false), "decided: too late");

        let (tx, _rx) = watch::channel(false);
        let r = Restart::new(Arc::new(tx));
        r.signalled();
        assert!(!r.claim(false), "stopping for good");
        assert_eq!(r.decide(), Outcome::NoJoin);

        let (tx, _rx) = watch::channel(false);
        let r = Restart::new(Arc::new(tx));
        assert!(r.claim(false));
        r.signalled();
        assert_eq!(
            r.decide(),
            Outcome::Join {
                force: false,
                signalled: true
            }
        );
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
