//! An SQLite file a store keeps its state in: one connection, its calls
//! one at a time on the blocking pool, each answered within the operation
//! timeout.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use rusqlite::Connection;

use super::OPERATION_TIMEOUT;

pub(crate) struct SqliteFile {
    /// The file's path, for messages.
    pub shown: String,
    connection: Arc<Mutex<Connection>>,
}

impl SqliteFile {
    /// Opens (creating it if needed) the file at `path` in WAL mode, a
    /// writer waiting up to the operation timeout for another's lock, and
    /// has `made` make its tables. Errors name `grant`.
    pub(crate) async fn open(
        path: &Path,
        grant: &str,
        made: fn(&mut Connection) -> rusqlite::Result<()>,
    ) -> Result<Self, String> {
        let shown = path.display().to_string();
        let opened = path.to_owned();
        let connection = tokio::task::spawn_blocking(move || {
            let mut connection = Connection::open(opened)?;
            connection.busy_timeout(OPERATION_TIMEOUT)?;
            connection.execute_batch("PRAGMA journal_mode = WAL;")?;
            made(&mut connection)?;
            Ok::<_, rusqlite::Error>(connection)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{grant}: cannot open the SQLite file {shown}: {e}"))?;
        Ok(SqliteFile {
            shown,
            connection: Arc::new(Mutex::new(connection)),
        })
    }

    /// Runs `work` on the connection, answering within the operation
    /// timeout: past it (a slow disk, or a call queued behind one) the
    /// outer error says so, and the work itself finishes on its thread.
    pub(crate) async fn run<T: Send + 'static, E: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    ) -> Result<Result<T, E>, String> {
        let connection = self.connection.clone();
        let done = tokio::task::spawn_blocking(move || {
            work(&mut connection.lock().unwrap_or_else(PoisonError::into_inner))
        });
        match tokio::time::timeout(OPERATION_TIMEOUT, done).await {
            Err(_) => Err(format!("no answer within {OPERATION_TIMEOUT:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(done)) => Ok(done),
        }
    }
}
