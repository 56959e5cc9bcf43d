//! Conversations in an embedded SQLite file: one row per message, in
//! order, and each conversation's size as stored beside them (kept in the
//! same transactions), so that an append checks its bounds without
//! reading the conversation. Calls run on the blocking pool, one at a time
//! per file.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use rusqlite::{Connection, params};

use super::{
    CONVERSATION_CAP, ConversationStore, LOAD_LIMIT, OPERATION_TIMEOUT, STORE_CAP,
    fits_a_conversation, full, unavailable,
};
use crate::types::{ChainError, Message};

pub(super) struct Sqlite {
    path: String,
    connection: Arc<Mutex<Connection>>,
}

impl Sqlite {
    /// Opens (creating it if needed) the file and its table.
    pub(super) async fn open(path: &Path) -> Result<Self, String> {
        let shown = path.display().to_string();
        let opened = path.to_owned();
        let connection = tokio::task::spawn_blocking(move || -> rusqlite::Result<Connection> {
            let connection = Connection::open(&opened)?;
            connection.busy_timeout(OPERATION_TIMEOUT)?;
            connection.execute_batch(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE IF NOT EXISTS shallot_messages (
                     seq INTEGER PRIMARY KEY AUTOINCREMENT,
                     conversation TEXT NOT NULL,
                     message TEXT NOT NULL
                 );
                 CREATE INDEX IF NOT EXISTS shallot_messages_by_conversation
                     ON shallot_messages (conversation, seq);",
            )?;
            // A file written before sizes were kept gets them once.
            let sized = connection.execute_batch(
                "CREATE TABLE shallot_conversation_sizes (
                     conversation TEXT PRIMARY KEY,
                     bytes INTEGER NOT NULL
                 );
                 INSERT INTO shallot_conversation_sizes
                     SELECT conversation, SUM(LENGTH(CAST(message AS BLOB)))
                     FROM shallot_messages GROUP BY conversation;",
            );
            if let Err(e) = sized
                && !e.to_string().contains("already exists")
            {
                return Err(e);
            }
            Ok(connection)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("grants.memory: cannot open the SQLite file {shown}: {e}"))?;
        Ok(Sqlite {
            path: shown,
            connection: Arc::new(Mutex::new(connection)),
        })
    }

    /// Runs `work` on the connection, answering within the operation
    /// timeout (a slow disk, or a call queued behind one, is a `transient`
    /// error then; the work itself finishes on its thread).
    async fn with<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, ChainError> {
        let connection = self.connection.clone();
        let done = tokio::task::spawn_blocking(move || {
            work(&mut connection.lock().unwrap_or_else(PoisonError::into_inner))
        });
        tokio::time::timeout(OPERATION_TIMEOUT, done)
            .await
            .map_err(|_| {
                unavailable(
                    &self.path,
                    format!("no answer within {OPERATION_TIMEOUT:?}"),
                )
            })?
            .map_err(|e| unavailable(&self.path, e))?
            .map_err(|e| unavailable(&self.path, e))
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
                    unavailable(&self.path, format!("a stored message is not readable: {e}"))
                })
            })
            .collect()
    }

    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError> {
        let conversation = conversation.to_owned();
        let rows: Vec<String> = messages
            .iter()
            .map(|m| serde_json::to_string(m).expect("a message serializes"))
            .collect();
        let added: usize = rows.iter().map(String::len).sum();
        fits_a_conversation(added)?;
        let full = || full(&self.path, STORE_CAP);
        let fitted = self
            .with(move |db| {
                let batch = db.transaction()?;
                let current: i64 = batch.query_row(
                    "SELECT COALESCE(SUM(bytes), 0) FROM shallot_conversation_sizes
                     WHERE conversation = ?1",
                    params![conversation],
                    |row| row.get(0),
                )?;
                let total: i64 = batch.query_row(
                    "SELECT COALESCE(SUM(bytes), 0) FROM shallot_conversation_sizes",
                    [],
                    |row| row.get(0),
                )?;
                let (current, total) = (current as usize, total as usize);
                // The oldest messages that must go for the new ones to fit.
                let over = (current + added).saturating_sub(CONVERSATION_CAP);
                let (mut freed, mut last) = (0, None);
                if over > 0 {
                    let mut oldest = batch.prepare_cached(
                        "SELECT seq, LENGTH(CAST(message AS BLOB)) FROM shallot_messages
                         WHERE conversation = ?1 ORDER BY seq",
                    )?;
                    let mut found = oldest.query(params![conversation])?;
                    while freed < over
                        && let Some(row) = found.next()?
                    {
                        last = Some(row.get::<_, i64>(0)?);
                        freed += row.get::<_, i64>(1)? as usize;
                    }
                }
                if total - freed.min(total) + added > STORE_CAP {
                    return Ok(false);
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
                    for row in &rows {
                        insert.execute(params![conversation, row])?;
                    }
                }
                batch.execute(
                    "INSERT INTO shallot_conversation_sizes (conversation, bytes) VALUES (?1, ?2)
                     ON CONFLICT (conversation) DO UPDATE SET bytes = ?2",
                    params![conversation, (current + added - freed.min(current)) as i64],
                )?;
                batch.commit()?;
                Ok(true)
            })
            .await?;
        if fitted { Ok(()) } else { Err(full()) }
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        let conversation = conversation.to_owned();
        self.with(move |db| {
            let batch = db.transaction()?;
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
