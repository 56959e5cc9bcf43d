//! The SQLite store's counters as a take sees them: in its write
//! transaction, so that a take refused part way is rolled back whole.

use rusqlite::Connection;

use super::{Failed, live, write};
use crate::kv::windows::Counters;
use crate::types::ChainError;

impl From<ChainError> for Failed {
    fn from(e: ChainError) -> Self {
        Failed::Refused(e)
    }
}

/// A namespace's counters in a write transaction, for a take by `owner`:
/// a take refused part way is rolled back whole.
pub(super) struct Transacted<'a> {
    pub db: &'a Connection,
    pub namespace: &'a str,
    pub owner: Option<&'a str>,
    pub now: i64,
}

impl Counters for Transacted<'_> {
    type Error = Failed;

    fn read(&mut self, key: &str) -> Result<Option<(String, Option<u64>)>, Failed> {
        let found = live(self.db, self.namespace, key, self.now)?;
        Ok(found.map(|live| (live.value, live.expires.map(|at| at.max(0) as u64))))
    }

    fn write(&mut self, key: &str, value: i64, expires: Option<u64>) -> Result<(), Failed> {
        let (expires, owner) = match live(self.db, self.namespace, key, self.now)? {
            Some(live) => (live.expires, live.owner),
            None => (expires.map(|at| at as i64), self.owner.map(str::to_owned)),
        };
        let space = (self.namespace, owner.as_deref());
        write(self.db, space, key, &value.to_string(), expires).map(drop)
    }

    fn room(&mut self, _: &[&str]) -> Result<(), Failed> {
        Ok(())
    }
}
