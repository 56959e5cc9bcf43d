//! Conversation stores: where the `memory` import keeps conversations, as
//! the operator chose in a filter's `grants.memory`:
//!
//! - a path (`conversations.db`): an embedded SQLite file, created when
//!   the filter loads;
//! - `redis://host:port/db` (or `rediss://`): Redis, so that several
//!   shallot processes, on several machines, share conversations;
//! - `:memory:`: in this process only (tests, demos); `:memory:<name>` is
//!   another in-process store, shared by the filters that name it.
//!
//! Filters granted the same store share one connection. A store that
//! cannot be opened fails the load; one that fails later (Redis going
//! away) fails the call with a `transient` error within a bounded time,
//! and works again once it is back.
//!
//! What a store keeps is bounded as it keeps it (each message as its JSON
//! encoding, which can be several times what a filter handed over): a
//! conversation keeps its latest [`CONVERSATION_CAP`] bytes (older
//! messages are dropped as new ones come), and a store holds at most
//! [`STORE_CAP`] bytes (the in-process one [`IN_PROCESS_CAP`]); an append
//! that would go past it is refused with `limit-exceeded`.
//!
//! A store is shared by tenants: the conversations of one owner (those
//! whose id starts `<owner>/`, as the gateway names them behind keys, and
//! as the `memory` import holds a filter to) are one part of it, which
//! holds at most a sixteenth of the store ([`PART_CAP`],
//! [`IN_PROCESS_PART_CAP`]), so one tenant's fill is no one else's
//! outage. Conversations of no owner (no `/`: a command line, a gateway
//! without keys) share the rest of the store.

mod redis;
mod sqlite;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use crate::store::{Registry, StoreSpec};
use crate::types::{Cause, ChainError, ErrorKind, Message, Weigh};

/// The most messages a load returns: the conversation's latest ones.
pub const LOAD_LIMIT: usize = 10_000;
/// The most one conversation keeps, in bytes as stored: past it, its
/// oldest messages are dropped.
pub const CONVERSATION_CAP: usize = 16 << 20;
/// The most an SQLite or Redis store holds, in bytes as stored.
pub const STORE_CAP: usize = 1 << 30;
/// The most the in-process store (`:memory:`) holds, in bytes as stored
/// (or as held, where that is more): it is the host's own memory.
pub const IN_PROCESS_CAP: usize = 256 << 20;
/// The most the conversations of one owner (one part) hold in an SQLite
/// or Redis store, in bytes as stored.
pub const PART_CAP: usize = STORE_CAP / 16;
/// The most the conversations of one owner hold in the in-process store.
pub const IN_PROCESS_PART_CAP: usize = IN_PROCESS_CAP / 16;

/// The part of a store `conversation` is in: its owner, before its first
/// `/`; `""` (no part, the whole store) for one without.
pub(crate) fn part(conversation: &str) -> &str {
    conversation.split_once('/').map_or("", |(owner, _)| owner)
}

/// The error for an append that would take an owner's part of a store
/// past its cap.
fn part_full(kind: &str, cap: usize) -> ChainError {
    ChainError::new(
        ErrorKind::LimitExceeded,
        format!(
            "the conversation store ({kind}) is full for this owner: its conversations hold at most {cap} bytes"
        ),
    )
}

/// Where conversations are kept.
#[async_trait]
pub trait ConversationStore: Send + Sync + 'static {
    /// The conversation's latest messages, oldest first: at most
    /// [`LOAD_LIMIT`] of them, and only as many of the latest as fit in
    /// `max_bytes` as the store keeps them, read newest first and no
    /// further, so that a load never reads more than its caller can hold;
    /// empty for one never written.
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError>;
    /// Appends messages to the conversation, dropping its oldest ones past
    /// [`CONVERSATION_CAP`] (an empty append changes nothing). Messages bigger than that together, or that
    /// would take the store past its cap, are refused (`limit-exceeded`)
    /// and nothing is written.
    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError>;
    /// Forgets the conversation.
    async fn clear(&self, conversation: &str) -> Result<(), ChainError>;
}

/// Opens the store `spec` names, or shares the one already open.
pub async fn open_store(spec: impl Into<StoreSpec>) -> Result<Arc<dyn ConversationStore>, String> {
    static OPEN: Registry<dyn ConversationStore> = Registry::new();
    OPEN.open(spec.into(), async |spec| {
        Ok(match spec {
            StoreSpec::InProcess(_) => Arc::new(InProcess::default()) as Arc<dyn ConversationStore>,
            StoreSpec::Redis(url) => Arc::new(redis::Redis::open(url).await?),
            StoreSpec::Sqlite(path) => Arc::new(sqlite::Sqlite::open(path).await?),
        })
    })
    .await
}

/// The bytes `message` takes as a store keeps it: its JSON encoding.
pub(crate) fn encoded_size(message: &Message) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, message).expect("a message serializes");
    count.0
}

/// What a store keeps for each message besides its JSON: a row's
/// bookkeeping, counted so that a flood of tiny messages is not free.
pub(crate) const ROW_BYTES: usize = 64;

/// What a message of `conversation` takes beside its JSON: the id (every
/// SQLite row and index entry holds it) and a row's bookkeeping.
pub(crate) fn row_overhead(conversation: &str) -> usize {
    conversation.len() + ROW_BYTES
}

/// The bytes `messages` of `conversation` take as a store keeps them.
pub(crate) fn stored_size(conversation: &str, messages: &[Message]) -> usize {
    let overhead = row_overhead(conversation);
    messages.iter().map(|m| encoded_size(m) + overhead).sum()
}

/// Checks an append of `added` bytes fits a conversation at all.
fn fits_a_conversation(added: usize) -> Result<(), ChainError> {
    if added > CONVERSATION_CAP {
        return Err(ChainError::new(
            ErrorKind::LimitExceeded,
            format!(
                "appending {added} bytes (as stored) at once, more than a conversation keeps ({CONVERSATION_CAP})"
            ),
        ));
    }
    Ok(())
}

/// The error for an append that would take a store past its cap. The
/// filter is told the kind of store; where it is goes to the log.
fn full(kind: &str, shown: &str, cap: usize) -> ChainError {
    tracing::warn!("the conversation store {shown} is full ({cap} bytes)");
    ChainError::new(
        ErrorKind::LimitExceeded,
        format!("the conversation store ({kind}) is full: it holds at most {cap} bytes"),
    )
}

/// A store's failure to answer, as a call sees it: the kind of store, not
/// where it is (that goes to the log).
pub(crate) fn unavailable(kind: &str, shown: &str, error: impl std::fmt::Display) -> ChainError {
    tracing::warn!("the conversation store {shown} failed: {error}");
    ChainError::new(
        ErrorKind::Transient,
        format!("the conversation store ({kind}) failed: {error}"),
    )
    .because(Cause::StoreUnavailable)
}

/// Conversations kept in this process, bounded like any store, in the
/// bytes each message takes as stored or as held, whichever is more.
#[derive(Default)]
struct InProcess {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    conversations: HashMap<String, Conversation>,
    bytes: usize,
    /// What each owner's conversations hold.
    parts: HashMap<String, usize>,
}

/// One conversation's messages, each with its size, oldest first.
#[derive(Default)]
struct Conversation {
    messages: VecDeque<(Message, usize)>,
    bytes: usize,
}

fn kept_size(conversation: &str, message: &Message) -> usize {
    encoded_size(message).max(message.weight()) + row_overhead(conversation)
}

impl InProcess {
    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl ConversationStore for InProcess {
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError> {
        let kept = self.kept();
        let Some(messages) = kept.conversations.get(conversation) else {
            return Ok(Vec::new());
        };
        let mut bytes = 0;
        let fitting = messages
            .messages
            .iter()
            .rev()
            .take(LOAD_LIMIT)
            .take_while(|(_, size)| {
                bytes += size;
                bytes <= max_bytes
            })
            .count();
        let skip = messages.messages.len() - fitting;
        Ok(messages
            .messages
            .iter()
            .skip(skip)
            .map(|(message, _)| message.clone())
            .collect())
    }

    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError> {
        if messages.is_empty() {
            return Ok(());
        }
        let sized: Vec<(Message, usize)> = messages
            .iter()
            .map(|m| (m.clone(), kept_size(conversation, m)))
            .collect();
        let added: usize = sized.iter().map(|(_, size)| size).sum();
        fits_a_conversation(added)?;
        let mut kept = self.kept();
        let current = kept.conversations.get(conversation);
        let (mut dropped, mut freed) = (0, 0);
        if let Some(current) = current {
            let mut over = (current.bytes + added).saturating_sub(CONVERSATION_CAP);
            for (_, size) in &current.messages {
                if over == 0 {
                    break;
                }
                over = over.saturating_sub(*size);
                freed += size;
                dropped += 1;
            }
        }
        if kept.bytes - freed + added > IN_PROCESS_CAP {
            return Err(full("in-process", "in this process", IN_PROCESS_CAP));
        }
        let owner = part(conversation);
        if !owner.is_empty() {
            let held = kept.parts.get(owner).copied().unwrap_or(0);
            if held - freed + added > IN_PROCESS_PART_CAP {
                return Err(part_full("in-process", IN_PROCESS_PART_CAP));
            }
            kept.parts.insert(owner.to_owned(), held - freed + added);
        }
        kept.bytes = kept.bytes - freed + added;
        let current = kept
            .conversations
            .entry(conversation.to_owned())
            .or_default();
        current.messages.drain(..dropped);
        current.messages.extend(sized);
        current.bytes = current.bytes - freed + added;
        Ok(())
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        let mut kept = self.kept();
        if let Some(gone) = kept.conversations.remove(conversation) {
            kept.bytes -= gone.bytes;
            if let Some(held) = kept.parts.get_mut(part(conversation)) {
                *held -= gone.bytes;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{ConversationStore, InProcess, ROW_BYTES, stored_size};
    use crate::types::Message;

    #[tokio::test]
    async fn an_empty_append_keeps_nothing_and_every_message_counts_its_row() {
        let store = InProcess::default();
        for i in 0..1000 {
            store.append(&format!("{i:0>500}"), &[]).await.unwrap();
        }
        assert_eq!(store.kept().conversations.len(), 0);
        assert_eq!(store.kept().bytes, 0);
        let id = "c".repeat(500);
        let tiny = [Message::user("")];
        assert!(stored_size(&id, &tiny) > 500 + ROW_BYTES);
        store.append(&id, &tiny).await.unwrap();
        assert!(
            store.kept().bytes > 500 + ROW_BYTES,
            "the id and the row count"
        );
        store.clear(&id).await.unwrap();
        assert_eq!(store.kept().bytes, 0);
    }
}
