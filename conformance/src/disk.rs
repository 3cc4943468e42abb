//! A small tmpfs for tests of a full disk (needs root: `mount`).

use std::path::{Path, PathBuf};

/// A small tmpfs mounted for one test, unmounted on drop.
pub struct SmallDisk {
    pub path: PathBuf,
    /// Removed on drop (a folder the test made for it).
    made: bool,
}

impl SmallDisk {
    /// A tmpfs of `size` (as `mount -o size=` takes it) on a folder of its own; `None`, with
    /// the reason printed, where the machine does not allow it.
    pub fn mount(size: &str) -> Option<SmallDisk> {
        let path = std::env::temp_dir().join(crate::unique("warren-small-disk"));
        std::fs::create_dir_all(&path).ok()?;
        let mut disk = Self::mount_at(&path, size)?;
        disk.made = true;
        Some(disk)
    }

    /// A tmpfs of `size` mounted on `path` (an empty folder, made if missing), hiding what
    /// the folder held until the drop unmounts it.
    pub fn mount_at(path: &Path, size: &str) -> Option<SmallDisk> {
        std::fs::create_dir_all(path).ok()?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk {
                path: path.to_path_buf(),
                made: false,
            }),
            Ok(o) => {
                eprintln!(
                    "SKIPPED: cannot mount a {size} tmpfs (needs root): {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("SKIPPED: cannot run mount: {e}");
                None
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazily: a broker still running on it (a test that failed early) keeps it until it
        // goes, instead of leaving it mounted for good.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.path)
            .status();
        if self.made {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
