//! Conversation history: what a turn loads before its new messages and
//! appends to as it runs, keyed by the context's `conversation_id`.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::types::Message;

/// Where conversations are kept between turns.
pub trait History: Send + Sync + 'static {
    /// The conversation's messages, oldest first (empty if unknown).
    fn load(&self, conversation: &str) -> Vec<Message>;

    /// Appends messages to the conversation.
    fn append(&self, conversation: &str, messages: &[Message]);
}

/// History kept in memory, for one process.
#[derive(Default)]
pub struct MemoryHistory {
    conversations: Mutex<HashMap<String, Vec<Message>>>,
}

impl History for MemoryHistory {
    fn load(&self, conversation: &str) -> Vec<Message> {
        let conversations = self
            .conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        conversations.get(conversation).cloned().unwrap_or_default()
    }

    fn append(&self, conversation: &str, messages: &[Message]) {
        let mut conversations = self
            .conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        conversations
            .entry(conversation.to_owned())
            .or_default()
            .extend_from_slice(messages);
    }
}

/// No history: every turn starts from its own messages. For a kernel whose
/// filters keep conversations themselves (the `memory` filter).
pub struct NoHistory;

impl History for NoHistory {
    fn load(&self, _: &str) -> Vec<Message> {
        Vec::new()
    }

    fn append(&self, _: &str, _: &[Message]) {}
}
