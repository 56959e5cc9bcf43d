//! What the chat and turn requests share: a conversation, read and
//! changed through their handles, every change charged to the filter.

use std::sync::Arc;

use wasmtime::component::Resource;

use super::HostState;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::convert;
use crate::types::{ChatRequest, Message, TurnRequest, Weigh};

/// A request that carries a conversation: a chat or a turn request.
pub(super) trait Conversation: Weigh + Send + 'static {
    fn conversation(&mut self) -> &mut Arc<Vec<Message>>;
}

impl Conversation for ChatRequest {
    fn conversation(&mut self) -> &mut Arc<Vec<Message>> {
        &mut self.messages
    }
}

impl Conversation for TurnRequest {
    fn conversation(&mut self) -> &mut Arc<Vec<Message>> {
        &mut self.messages
    }
}

/// The message accessors chat and turn requests share.
impl HostState {
    pub(super) fn read_messages<T: Conversation>(
        &mut self,
        this: &Resource<T>,
    ) -> wasmtime::Result<Vec<wit::Message>> {
        Ok(convert::messages(self.table.get_mut(this)?.conversation()))
    }

    pub(super) fn count_messages<T: Conversation>(
        &mut self,
        this: &Resource<T>,
    ) -> wasmtime::Result<u32> {
        Ok(self.table.get_mut(this)?.conversation().len() as u32)
    }

    pub(super) fn replace_messages<T: Conversation>(
        &mut self,
        this: &Resource<T>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<()> {
        *self.table.get_mut(this)?.conversation() = Arc::new(convert::from_messages(messages));
        self.recharge(this)
    }

    pub(super) fn append_message<T: Conversation>(
        &mut self,
        this: &Resource<T>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        Arc::make_mut(self.table.get_mut(this)?.conversation()).push(message.into());
        self.recharge(this)
    }
}
