//! Conversation stores: where the `memory` import keeps conversations, as
//! the operator chose in a filter's `grants.memory`:
//!
//! - a path (`conversations.db`): an embedded SQLite file, created when
//!   the filter loads;
//! - `redis://host:port/db` (or `rediss://`): Redis, so that several
//!   shallot processes, on several machines, share conversations;
//! - `:memory:`: in this process only (tests, demos).
//!
//! Filters granted the same store share one connection. A store that
//! cannot be opened fails the load; one that fails later (Redis going
//! away) fails the call with a `transient` error within a bounded time,
//! and works again once it is back.

mod redis;
mod sqlite;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;

use crate::types::{ChainError, ErrorKind, Message, Weigh};

/// The most messages a load returns: the conversation's latest ones.
pub const LOAD_LIMIT: usize = 10_000;
/// How long one store operation may take before it is a `transient` error.
pub(crate) const OPERATION_TIMEOUT: Duration = Duration::from_secs(2);

/// Where conversations are kept.
#[async_trait]
pub trait ConversationStore: Send + Sync + 'static {
    /// The conversation's latest messages, oldest first: at most
    /// [`LOAD_LIMIT`] of them, and only as many of the latest as fit in
    /// `max_bytes` as the store keeps them, read newest first and no
    /// further, so that a load never reads more than its caller can hold;
    /// empty for one never written.
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError>;
    /// Appends messages to the conversation.
    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError>;
    /// Forgets the conversation.
    async fn clear(&self, conversation: &str) -> Result<(), ChainError>;
}

/// Opens the store `spec` names, or shares the one already open.
pub async fn open_store(spec: &str) -> Result<Arc<dyn ConversationStore>, String> {
    static OPEN: Mutex<Option<HashMap<String, Weak<dyn ConversationStore>>>> = Mutex::new(None);
    if let Some(store) = OPEN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_default()
        .get(spec)
        .and_then(Weak::upgrade)
    {
        return Ok(store);
    }
    let store: Arc<dyn ConversationStore> = if spec == ":memory:" {
        Arc::new(InProcess::default())
    } else if spec.starts_with("redis://") || spec.starts_with("rediss://") {
        Arc::new(redis::Redis::open(spec).await?)
    } else {
        Arc::new(sqlite::Sqlite::open(std::path::Path::new(spec)).await?)
    };
    OPEN.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_default()
        .insert(spec.to_owned(), Arc::downgrade(&store));
    Ok(store)
}

/// A store's failure to answer, as a call sees it.
pub(crate) fn unavailable(store: &str, error: impl std::fmt::Display) -> ChainError {
    ChainError::new(
        ErrorKind::Transient,
        format!("the conversation store ({store}) failed: {error}"),
    )
}

/// Conversations kept in this process.
#[derive(Default)]
struct InProcess {
    conversations: Mutex<HashMap<String, Vec<Message>>>,
}

#[async_trait]
impl ConversationStore for InProcess {
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError> {
        let conversations = self
            .conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let messages = conversations
            .get(conversation)
            .map_or(&[][..], Vec::as_slice);
        let mut bytes = 0;
        let fitting = messages
            .iter()
            .rev()
            .take(LOAD_LIMIT)
            .take_while(|message| {
                bytes += message.weight();
                bytes <= max_bytes
            })
            .count();
        Ok(messages[messages.len() - fitting..].to_vec())
    }

    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError> {
        self.conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(conversation.to_owned())
            .or_default()
            .extend_from_slice(messages);
        Ok(())
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        self.conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(conversation);
        Ok(())
    }
}
