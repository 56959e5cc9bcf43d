//! Conversations in an embedded SQLite file: one row per message, in
//! order, and each conversation's size and each owner's part's as stored
//! beside them (kept in the same transactions), so that an append checks
//! its bounds without reading the conversation. Calls run on the blocking
//! pool, one at a time per file.

use std::path::Path;

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, params};

use super::{
    CONVERSATION_CAP, ConversationStore, LOAD_LIMIT, PART_CAP, ROW_BYTES, STORE_CAP,
    fits_a_conversation, full, part, part_full, row_overhead, unavailable,
};
use crate::store::SqliteFile;
use crate::types::{ChainError, Message};

/// A row's size as the store counts it, in SQL: its message's bytes, its
/// conversation's and the row's bookkeeping (see `row_overhead`).
fn row_size() -> String {
    format!("LENGTH(CAST(message AS BLOB)) + LENGTH(CAST(conversation AS BLOB)) + {ROW_BYTES}")
}

pub(super) struct Sqlite {
    file: SqliteFile,
}

/// Makes the file's tables and keeps its sizes.
fn made(connection: &mut Connection) -> rusqlite::Result<()> {
    connection.execute_batch(
        "CREATE TABLE IF NOT EXISTS shallot_messages (
             seq INTEGER PRIMARY KEY AUTOINCREMENT,
             conversation TEXT NOT NULL,
             message TEXT NOT NULL
         );
         CREATE INDEX IF NOT EXISTS shallot_messages_by_conversation
             ON shallot_messages (conversation, seq);",
    )?;
    sized(connection)
}

/// Gives a file written before sizes were kept its sizes, once, in one
/// transaction (and a second opener finds them made).
fn sized(connection: &mut Connection) -> rusqlite::Result<()> {
    let sizes = connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let made: bool = sizes.query_row(
        "SELECT COUNT(*) > 0 FROM sqlite_master WHERE name = 'shallot_store_size'",
        [],
        |row| row.get(0),
    )?;
    if !made {
        sizes.execute_batch(&format!(
            "CREATE TABLE IF NOT EXISTS shallot_conversation_sizes (
                 conversation TEXT PRIMARY KEY,
                 bytes INTEGER NOT NULL
             );
             DELETE FROM shallot_conversation_sizes;
             INSERT INTO shallot_conversation_sizes
                 SELECT conversation, SUM({})
                 FROM shallot_messages GROUP BY conversation;
             CREATE TABLE shallot_store_size (
                 id INTEGER PRIMARY KEY CHECK (id = 0),
                 bytes INTEGER NOT NULL
             );
             INSERT INTO shallot_store_size
                 SELECT 0, COALESCE(SUM(bytes), 0) FROM shallot_conversation_sizes;",
            row_size()
        ))?;
    }
    // Each owner's part's size, made once from the conversations'.
    let parted: bool = sizes.query_row(
        "SELECT COUNT(*) > 0 FROM sqlite_master WHERE name = 'shallot_part_sizes'",
        [],
        |row| row.get(0),
    )?;
    if !parted {
        sizes.execute_batch(
            "CREATE TABLE shallot_part_sizes (
                 part TEXT PRIMARY KEY,
                 bytes INTEGER NOT NULL
             );
             INSERT INTO shallot_part_sizes
                 SELECT SUBSTR(conversation, 1, INSTR(conversation, '/') - 1), SUM(bytes)
                 FROM shallot_conversation_sizes
                 WHERE INSTR(conversation, '/') > 1 GROUP BY 1;",
        )?;
    }
    sizes.commit()
}

impl Sqlite {
    /// Opens (creating it if needed) the file and its table.
    pub(super) async fn open(path: &Path) -> Result<Self, String> {
        let file = SqliteFile::open(path, "grants.memory", made).await?;
        Ok(Sqlite { file })
    }

    /// Runs `work` on the connection, answering within the operation
    /// timeout (a slow disk, or a call queued behind one, is a `transient`
    /// error then; the work itself finishes on its thread).
    async fn with<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, ChainError> {
        let failed = |e: &dyn std::fmt::Display| unavailable("SQLite", &self.file.shown, e);
        match self.file.run(work).await {
            Err(e) => Err(failed(&e)),
            Ok(done) => done.map_err(|e| failed(&e)),
        }
    }
}

#[async_trait]
impl ConversationStore for Sqlite {
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError> {
        let conversation = conversation.to_owned();
        let mut rows = self
            .with(move |db| {
                let mut query = db.prepare_cached(
                    "SELECT LENGTH(CAST(message AS BLOB)), message FROM shallot_messages
                     WHERE conversation = ?1 ORDER BY seq DESC LIMIT ?2",
                )?;
                let mut found = query.query(params![conversation, LOAD_LIMIT as i64])?;
                // Newest first, and no further than fits.
                let (mut rows, mut bytes) = (Vec::new(), 0);
                while let Some(row) = found.next()? {
                    bytes += row.get::<_, i64>(0)? as usize;
                    if bytes > max_bytes {
                        break;
                    }
                    rows.push(row.get::<_, String>(1)?);
                }
                Ok(rows)
            })
            .await?;
        rows.reverse();
        rows.iter()
            .map(|row| {
                serde_json::from_str(row).map_err(|e| {
                    unavailable(
                        "SQLite",
                        &self.file.shown,
                        format!("a stored message is not readable: {e}"),
                    )
                })
            })
            .collect()
    }

    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError> {
        if messages.is_empty() {
            return Ok(());
        }
        let overhead = row_overhead(conversation);
        let conversation = conversation.to_owned();
        let rows: Vec<String> = messages
            .iter()
            .map(|m| serde_json::to_string(m).expect("a message serializes"))
            .collect();
        let added: usize = rows.iter().map(|row| row.len() + overhead).sum();
        fits_a_conversation(added)?;
        let fitted = self
            .with(move |db| append_rows(db, &conversation, &rows, added, overhead))
            .await?;
        match fitted {
            Fitted::Yes => Ok(()),
            Fitted::StoreFull => Err(full("SQLite", &self.file.shown, STORE_CAP)),
            Fitted::PartFull => Err(part_full("SQLite", PART_CAP)),
        }
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        let conversation = conversation.to_owned();
        self.with(move |db| {
            let batch = db.transaction()?;
            batch.execute(
                "UPDATE shallot_store_size SET bytes = MAX(0, bytes - COALESCE(
                     (SELECT bytes FROM shallot_conversation_sizes WHERE conversation = ?1), 0))
                 WHERE id = 0",
                params![conversation],
            )?;
            batch.execute(
                "UPDATE shallot_part_sizes SET bytes = MAX(0, bytes - COALESCE(
                     (SELECT bytes FROM shallot_conversation_sizes WHERE conversation = ?1), 0))
                 WHERE part = ?2",
                params![conversation, part(&conversation)],
            )?;
            for table in ["shallot_messages", "shallot_conversation_sizes"] {
                batch.execute(
                    &format!("DELETE FROM {table} WHERE conversation = ?1"),
                    params![conversation],
                )?;
            }
            batch.commit()
        })
        .await
    }
}

/// Whether an append fitted, or which cap it would have passed.
enum Fitted {
    Yes,
    StoreFull,
    PartFull,
}

/// Appends `rows` (`added` bytes as stored) to `conversation` in one
/// transaction, dropping its oldest messages past the conversation cap;
/// nothing is written when the store, or its owner's part, would be over
/// its cap.
fn append_rows(
    db: &mut Connection,
    conversation: &str,
    rows: &[String],
    added: usize,
    overhead: usize,
) -> rusqlite::Result<Fitted> {
    let batch = db.transaction()?;
    let current: i64 = batch.query_row(
        "SELECT COALESCE(SUM(bytes), 0) FROM shallot_conversation_sizes
         WHERE conversation = ?1",
        params![conversation],
        |row| row.get(0),
    )?;
    let total: i64 = batch.query_row(
        "SELECT bytes FROM shallot_store_size WHERE id = 0",
        [],
        |row| row.get(0),
    )?;
    let (current, total) = (current as usize, total as usize);
    // The oldest messages that must go for the new ones to fit.
    let over = (current + added).saturating_sub(CONVERSATION_CAP);
    let (freed, last) = oldest(&batch, conversation, over, overhead)?;
    if total - freed.min(total) + added > STORE_CAP {
        return Ok(Fitted::StoreFull);
    }
    if !part_fits(&batch, part(conversation), freed, added)? {
        return Ok(Fitted::PartFull);
    }
    if let Some(last) = last {
        batch.execute(
            "DELETE FROM shallot_messages WHERE conversation = ?1 AND seq <= ?2",
            params![conversation, last],
        )?;
    }
    {
        let mut insert = batch.prepare_cached(
            "INSERT INTO shallot_messages (conversation, message) VALUES (?1, ?2)",
        )?;
        for row in rows {
            insert.execute(params![conversation, row])?;
        }
    }
    batch.execute(
        "INSERT INTO shallot_conversation_sizes (conversation, bytes) VALUES (?1, ?2)
         ON CONFLICT (conversation) DO UPDATE SET bytes = ?2",
        params![conversation, (current + added - freed.min(current)) as i64],
    )?;
    batch.execute(
        "UPDATE shallot_store_size SET bytes = ?1 WHERE id = 0",
        params![(total + added - freed.min(total)) as i64],
    )?;
    batch.commit()?;
    Ok(Fitted::Yes)
}

/// Whether `added` bytes, `freed` given back, fit the part of `owner`
/// (none: the conversation is no one's), its size updated if they do.
fn part_fits(
    batch: &rusqlite::Transaction<'_>,
    owner: &str,
    freed: usize,
    added: usize,
) -> rusqlite::Result<bool> {
    if owner.is_empty() {
        return Ok(true);
    }
    let held: i64 = batch
        .query_row(
            "SELECT bytes FROM shallot_part_sizes WHERE part = ?1",
            params![owner],
            |row| row.get(0),
        )
        .optional()?
        .unwrap_or(0);
    let held = held as usize;
    if held - freed.min(held) + added > PART_CAP {
        return Ok(false);
    }
    batch.execute(
        "INSERT INTO shallot_part_sizes (part, bytes) VALUES (?1, ?2)
         ON CONFLICT (part) DO UPDATE SET bytes = ?2",
        params![owner, (held - freed.min(held) + added) as i64],
    )?;
    Ok(true)
}

/// How many bytes the oldest messages of `conversation` free, taken until
/// at least `over` are, and the sequence number of the last of them.
fn oldest(
    batch: &rusqlite::Transaction<'_>,
    conversation: &str,
    over: usize,
    overhead: usize,
) -> rusqlite::Result<(usize, Option<i64>)> {
    let (mut freed, mut last) = (0, None);
    if over == 0 {
        return Ok((freed, last));
    }
    let mut oldest = batch.prepare_cached(
        "SELECT seq, LENGTH(CAST(message AS BLOB)) FROM shallot_messages
         WHERE conversation = ?1 ORDER BY seq",
    )?;
    let mut found = oldest.query(params![conversation])?;
    while freed < over
        && let Some(row) = found.next()?
    {
        last = Some(row.get::<_, i64>(0)?);
        freed += row.get::<_, i64>(1)? as usize + overhead;
    }
    Ok((freed, last))
}
