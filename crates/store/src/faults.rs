//! Fault injection for tests: a hook in [`Store::write`] that fails, delays or half-completes
//! chosen writes. Compiled only into the store's own tests and into builds that enable the
//! `fault-injection` feature (other crates' tests, as a dev-dependency), so a release build
//! carries neither the hook nor its check on the write path.

use std::sync::Mutex;
use std::time::Duration;

use warren_broker::WriteBatch;

use crate::{Store, StoreError};

/// What the hook does to one group write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The write goes through.
    None,
    /// The write fails before anything reaches RocksDB (a full disk, a refused WAL append).
    Fail,
    /// The write reaches RocksDB and is then reported failed (an fsync error after the
    /// append): the caller cannot tell what is on disk.
    FailAfterWrite,
    /// The write waits, then goes through (a slow disk).
    Delay(Duration),
}

type Decide = Box<dyn FnMut(&[WriteBatch]) -> Fault + Send>;

/// The hook a store carries in test builds.
#[derive(Default)]
pub(crate) struct Hook(Mutex<Option<Decide>>);

/// What [`Store::write`] does after its real write.
pub(crate) enum After {
    Nothing,
    Fail(&'static str),
}

impl Hook {
    pub(crate) fn before_write(&self, batches: &[WriteBatch]) -> Result<After, StoreError> {
        let fault = match self.0.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(decide) => decide(batches),
            None => Fault::None,
        };
        match fault {
            Fault::None => Ok(After::Nothing),
            Fault::Fail => Err(StoreError::Injected("write refused")),
            Fault::FailAfterWrite => Ok(After::Fail("write done, then reported failed")),
            Fault::Delay(d) => {
                std::thread::sleep(d);
                Ok(After::Nothing)
            }
        }
    }
}

impl Store {
    /// From now on every group write asks `decide` what to do with it.
    pub fn set_faults(&self, decide: impl FnMut(&[WriteBatch]) -> Fault + Send + 'static) {
        *self.faults.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(decide));
    }

    /// Writes go through again.
    pub fn clear_faults(&self) {
        *self.faults.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}
