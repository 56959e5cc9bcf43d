//! Keys in an embedded SQLite file: a row per key with its value, version
//! and expiry (milliseconds since the Unix epoch, so that processes
//! sharing the file agree), the versions drawn from one counter row, every
//! write one immediate transaction (so compare-and-set and add are atomic
//! for every process on the file; a read is a deferred one). Commits are
//! not synced one by one (`synchronous = NORMAL`): a crash of the process
//! loses nothing, a power cut at most the last writes, which for counters
//! and caches is the right trade. The file is capped at [`STORE_CAP`]
//! (`max_page_count`); a write that would pass it first sweeps the expired
//! rows. Each namespace holds at most [`STORED_NAMESPACE_CAP`] bytes,
//! counted in the same transaction as its writes (`shallot_kv_bytes`); a
//! write past it first sweeps the namespace's expired rows. Calls run on
//! the blocking pool, one at a time per file.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::windows::{self, Period, Taken, Window};
use super::{
    Count, ENTRY_BYTES, Entry, KvStore, STORE_CAP, STORED_NAMESPACE_CAP, counter, full, owner_cap,
    owner_full, sum, unavailable,
};
use crate::store::SqliteFile;
use crate::types::ChainError;

pub(super) struct Sqlite {
    file: SqliteFile,
}

/// Now, in milliseconds since the Unix epoch.
fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn expiry(ttl: Option<Duration>, now: i64) -> Option<i64> {
    ttl.map(|ttl| now.saturating_add(ttl.as_millis() as i64))
}

/// Why a write did not happen: the caller's error, or the database's.
enum Failed {
    Refused(ChainError),
    Db(rusqlite::Error),
}

impl From<rusqlite::Error> for Failed {
    fn from(e: rusqlite::Error) -> Self {
        Failed::Db(e)
    }
}

fn is_full(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull)
}

/// The live row of a key: its value, version and expiry.
fn live(db: &Connection, namespace: &str, key: &str, now: i64) -> rusqlite::Result<Option<Live>> {
    db.prepare_cached(
        "SELECT value, version, expires, owner FROM shallot_kv
         WHERE namespace = ?1 AND key = ?2 AND (expires IS NULL OR expires > ?3)",
    )?
    .query_row(params![namespace, key, now], |row| {
        Ok(Live {
            value: row.get(0)?,
            version: row.get::<_, i64>(1)? as u64,
            expires: row.get(2)?,
            owner: row.get(3)?,
        })
    })
    .optional()
}

/// A live row: its value, version, expiry and owner.
struct Live {
    value: String,
    version: u64,
    expires: Option<i64>,
    owner: Option<String>,
}

/// What a row counts against its namespace's cap and its owner's part.
fn size(key: &str, value: &str) -> i64 {
    (key.len() + value.len() + ENTRY_BYTES) as i64
}

/// What the row of `key` counts now, live or expired (0: none), and whose
/// part it counts in.
fn counted(db: &Connection, namespace: &str, key: &str) -> rusqlite::Result<(i64, Option<String>)> {
    let row: Option<(String, Option<String>)> = db
        .prepare_cached("SELECT value, owner FROM shallot_kv WHERE namespace = ?1 AND key = ?2")?
        .query_row(params![namespace, key], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .optional()?;
    Ok(row.map_or((0, None), |(value, owner)| (size(key, &value), owner)))
}

/// What `namespace` holds, and, with `owner`, what that owner's keys do.
fn held(db: &Connection, namespace: &str, owner: Option<&str>) -> rusqlite::Result<i64> {
    let held = match owner {
        None => db
            .prepare_cached("SELECT bytes FROM shallot_kv_bytes WHERE namespace = ?1")?
            .query_row(params![namespace], |row| row.get(0))
            .optional()?,
        Some(owner) => db
            .prepare_cached(
                "SELECT bytes FROM shallot_kv_owner_bytes WHERE namespace = ?1 AND owner = ?2",
            )?
            .query_row(params![namespace, owner], |row| row.get(0))
            .optional()?,
    };
    Ok(held.unwrap_or(0))
}

/// Adds `delta` to what `namespace` holds, and to `owner`'s part of it.
fn hold(db: &Connection, namespace: &str, owner: Option<&str>, delta: i64) -> rusqlite::Result<()> {
    db.prepare_cached(
        "INSERT INTO shallot_kv_bytes VALUES (?1, ?2)
         ON CONFLICT (namespace) DO UPDATE SET bytes = bytes + ?2",
    )?
    .execute(params![namespace, delta])?;
    if let Some(owner) = owner {
        db.prepare_cached(
            "INSERT INTO shallot_kv_owner_bytes VALUES (?1, ?2, ?3)
             ON CONFLICT (namespace, owner) DO UPDATE SET bytes = bytes + ?3",
        )?
        .execute(params![namespace, owner, delta])?;
    }
    Ok(())
}

/// Gives back the rooms of the rows `delete` (a `DELETE ... RETURNING
/// namespace, owner, size`) removes.
fn give_back(db: &Connection, delete: &str, args: impl rusqlite::Params) -> rusqlite::Result<()> {
    let swept: Vec<(String, Option<String>, i64)> = db
        .prepare_cached(delete)?
        .query_map(args, |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (namespace, owner, bytes) in swept {
        hold(db, &namespace, owner.as_deref(), -bytes)?;
    }
    Ok(())
}

/// A row's size, in SQL, as [`size`] counts it.
const ROW_SIZE: &str = "length(CAST(key AS BLOB)) + length(CAST(value AS BLOB))";

/// Writes a key for `owner` with the file's next version, within its
/// namespace's cap and the owner's part of it (the namespace's expired
/// rows swept before a write is refused).
fn write(
    db: &Connection,
    (namespace, owner): (&str, Option<&str>),
    key: &str,
    value: &str,
    expires: Option<i64>,
) -> Result<u64, Failed> {
    let new = size(key, value);
    let room = |db: &Connection| -> Result<(), Failed> {
        let (old, old_owner) = counted(db, namespace, key)?;
        if held(db, namespace, None)? - old + new > STORED_NAMESPACE_CAP as i64 {
            let full = full("SQLite, this namespace", STORED_NAMESPACE_CAP);
            return Err(Failed::Refused(full));
        }
        if let Some(owner) = owner {
            let mine = if old_owner.as_deref() == Some(owner) {
                old
            } else {
                0
            };
            let cap = owner_cap(STORED_NAMESPACE_CAP);
            if held(db, namespace, Some(owner))? - mine + new > cap as i64 {
                return Err(Failed::Refused(owner_full("SQLite", cap)));
            }
        }
        Ok(())
    };
    if room(db).is_err() {
        give_back(
            db,
            &format!(
                "DELETE FROM shallot_kv WHERE namespace = ?1 AND expires <= ?2
                 RETURNING namespace, owner, {ROW_SIZE} + ?3"
            ),
            params![namespace, now(), ENTRY_BYTES as i64],
        )?;
        room(db)?;
    }
    let (old, old_owner) = counted(db, namespace, key)?;
    hold(db, namespace, old_owner.as_deref(), -old)?;
    hold(db, namespace, owner, new)?;
    let version: i64 = db.query_row(
        "UPDATE shallot_kv_version SET n = n + 1 WHERE id = 0 RETURNING n",
        [],
        |row| row.get(0),
    )?;
    db.prepare_cached(
        "INSERT OR REPLACE INTO shallot_kv (namespace, key, value, version, expires, owner)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![namespace, key, value, version, expires, owner])?;
    Ok(version as u64)
}

/// Deletes every expired row of the file, giving back each namespace's
/// and owner's room, in one transaction.
fn sweep_all(db: &mut Connection) -> rusqlite::Result<()> {
    let transaction = db.transaction_with_behavior(TransactionBehavior::Immediate)?;
    give_back(
        &transaction,
        &format!(
            "DELETE FROM shallot_kv WHERE expires <= ?1
             RETURNING namespace, owner, {ROW_SIZE} + ?2"
        ),
        params![now(), ENTRY_BYTES as i64],
    )?;
    transaction.commit()
}

/// Makes the file's tables and brings them up to date.
fn made(connection: &mut Connection) -> rusqlite::Result<()> {
    let page: i64 = connection.query_row("PRAGMA page_size", [], |row| row.get(0))?;
    connection.execute_batch(&schema(page))?;
    owners(connection)
}

/// The file's settings and tables, its cap in pages of `page` bytes.
fn schema(page: i64) -> String {
    format!(
        "PRAGMA synchronous = NORMAL;
         PRAGMA max_page_count = {};
         CREATE TABLE IF NOT EXISTS shallot_kv (
             namespace TEXT NOT NULL,
             key TEXT NOT NULL,
             value TEXT NOT NULL,
             version INTEGER NOT NULL,
             expires INTEGER,
             owner TEXT,
             PRIMARY KEY (namespace, key)
         ) WITHOUT ROWID;
         CREATE TABLE IF NOT EXISTS shallot_kv_version (
             id INTEGER PRIMARY KEY CHECK (id = 0),
             n INTEGER NOT NULL
         );
         INSERT OR IGNORE INTO shallot_kv_version VALUES (0, 0);
         CREATE TABLE IF NOT EXISTS shallot_kv_bytes (
             namespace TEXT PRIMARY KEY,
             bytes INTEGER NOT NULL
         ) WITHOUT ROWID;
         INSERT OR IGNORE INTO shallot_kv_bytes
             SELECT namespace, SUM({ROW_SIZE} + {ENTRY_BYTES})
             FROM shallot_kv GROUP BY namespace;
         CREATE TABLE IF NOT EXISTS shallot_kv_owner_bytes (
             namespace TEXT NOT NULL,
             owner TEXT NOT NULL,
             bytes INTEGER NOT NULL,
             PRIMARY KEY (namespace, owner)
         ) WITHOUT ROWID;",
        STORE_CAP as i64 / page,
    )
}

/// Gives a file from before owners were kept the column: its keys are no
/// one's. Another process may add the column first.
fn owners(db: &Connection) -> rusqlite::Result<()> {
    let owned = || -> rusqlite::Result<bool> {
        db.query_row(
            "SELECT COUNT(*) > 0 FROM pragma_table_info('shallot_kv') WHERE name = 'owner'",
            [],
            |row| row.get(0),
        )
    };
    if !owned()?
        && let Err(e) = db.execute("ALTER TABLE shallot_kv ADD COLUMN owner TEXT", [])
        && !owned()?
    {
        return Err(e);
    }
    Ok(())
}

impl Sqlite {
    /// Opens (creating it if needed) the file and its tables.
    pub(super) async fn open(path: &Path) -> Result<Self, String> {
        let file = SqliteFile::open(path, "grants.kv", made).await?;
        Ok(Sqlite { file })
    }

    /// Runs `work` in one transaction on the blocking pool,
    /// answering within the operation timeout. A write the file's cap
    /// refuses sweeps the expired rows and is tried once more.
    async fn with<T: Send + 'static>(
        &self,
        behavior: TransactionBehavior,
        work: impl Fn(&Connection, i64) -> Result<T, Failed> + Send + 'static,
    ) -> Result<T, ChainError> {
        let attempt = move |db: &mut Connection| -> Result<T, Failed> {
            let transaction = db.transaction_with_behavior(behavior)?;
            let done = work(&transaction, now())?;
            transaction.commit()?;
            Ok(done)
        };
        let done = self.file.run(move |db| match attempt(db) {
            Err(Failed::Db(e)) if is_full(&e) => {
                sweep_all(db)?;
                attempt(db)
            }
            done => done,
        });
        let failed = |e: &dyn std::fmt::Display| unavailable("SQLite", &self.file.shown, e);
        match done.await {
            Err(e) => Err(failed(&e)),
            Ok(Ok(done)) => Ok(done),
            Ok(Err(Failed::Refused(e))) => Err(e),
            Ok(Err(Failed::Db(e))) if is_full(&e) => Err(full("SQLite", STORE_CAP)),
            Ok(Err(Failed::Db(e))) => Err(failed(&e)),
        }
    }
}

#[async_trait]
impl KvStore for Sqlite {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Entry>, ChainError> {
        let (namespace, key) = (namespace.to_owned(), key.to_owned());
        self.with(TransactionBehavior::Deferred, move |db, now| {
            let found = live(db, &namespace, &key, now)?;
            Ok(found.map(|live| Entry {
                value: live.value,
                version: live.version,
            }))
        })
        .await
    }

    async fn set(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        ttl: Option<Duration>,
    ) -> Result<u64, ChainError> {
        let (namespace, key, value) = (namespace.to_owned(), key.to_owned(), value.to_owned());
        let owner = owner.map(str::to_owned);
        self.with(TransactionBehavior::Immediate, move |db, now| {
            let space = (namespace.as_str(), owner.as_deref());
            write(db, space, &key, &value, expiry(ttl, now))
        })
        .await
    }

    async fn swap(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        expected: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, ChainError> {
        let (namespace, key, value) = (namespace.to_owned(), key.to_owned(), value.to_owned());
        let owner = owner.map(str::to_owned);
        self.with(TransactionBehavior::Immediate, move |db, now| {
            let current = live(db, &namespace, &key, now)?.map_or(0, |live| live.version);
            if current != expected {
                return Ok(None);
            }
            let space = (namespace.as_str(), owner.as_deref());
            Ok(Some(write(db, space, &key, &value, expiry(ttl, now))?))
        })
        .await
    }

    async fn add(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        delta: i64,
        ttl: Option<Duration>,
    ) -> Result<Count, ChainError> {
        let (namespace, key) = (namespace.to_owned(), key.to_owned());
        let owner = owner.map(str::to_owned);
        self.with(TransactionBehavior::Immediate, move |db, now| {
            // A counter stays in its creator's part.
            let (current, expires, owner) = match live(db, &namespace, &key, now)? {
                Some(live) => (
                    counter(&live.value).map_err(Failed::Refused)?,
                    live.expires,
                    live.owner,
                ),
                None => (0, expiry(ttl, now), owner.clone()),
            };
            let value = sum(current, delta).map_err(Failed::Refused)?;
            let space = (namespace.as_str(), owner.as_deref());
            write(db, space, &key, &value.to_string(), expires)?;
            let ttl = expires.map(|at| Duration::from_millis(at.saturating_sub(now).max(0) as u64));
            Ok(Count { value, ttl })
        })
        .await
    }

    async fn delete(&self, namespace: &str, key: &str) -> Result<bool, ChainError> {
        let (namespace, key) = (namespace.to_owned(), key.to_owned());
        self.with(TransactionBehavior::Immediate, move |db, now| {
            let was = live(db, &namespace, &key, now)?.is_some();
            give_back(
                db,
                &format!(
                    "DELETE FROM shallot_kv WHERE namespace = ?1 AND key = ?2
                     RETURNING namespace, owner, {ROW_SIZE} + ?3"
                ),
                params![namespace, key, ENTRY_BYTES as i64],
            )?;
            Ok(was)
        })
        .await
    }

    async fn take(
        &self,
        namespace: &str,
        owner: Option<&str>,
        windows: &[Window],
    ) -> Result<Taken, ChainError> {
        let (namespace, windows) = (namespace.to_owned(), windows.to_vec());
        let owner = owner.map(str::to_owned);
        self.with(TransactionBehavior::Immediate, move |db, now| {
            let mut counters = counters::Transacted {
                db,
                namespace: &namespace,
                owner: owner.as_deref(),
                now,
            };
            windows::take(&mut counters, now.max(0) as u64, &windows)
        })
        .await
    }

    async fn settle(
        &self,
        namespace: &str,
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, ChainError> {
        let (namespace, key) = (namespace.to_owned(), key.to_owned());
        self.with(TransactionBehavior::Immediate, move |db, now| {
            let mut counters = counters::Transacted {
                db,
                namespace: &namespace,
                owner: None,
                now,
            };
            windows::settle(&mut counters, &key, period, ends_ms, delta)
        })
        .await
    }
}

mod counters;
#[cfg(test)]
mod tests;
