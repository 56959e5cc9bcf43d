//! `memory.load`/`append`/`clear` (`grants.memory`): the conversation store
//! the operator named, opened at load, from around hooks only. Ids of 1 to
//! [`CONVERSATION_ID_CAP`] bytes; behind client keys only the invoke's
//! owner's conversations (ids that start `<owner>/`, as the gateway names
//! them), in that owner's part of the store; [`STORE_OPS_PER_CALL`]
//! operations a call, appends of no more than the filter's host memory cap
//! a call as the store keeps them; a load returns the latest messages that
//! fit in half the filter's free host memory.

use std::sync::Arc;

use super::HostState;
use super::service::{AROUND, GrantedServices, Service, Spent, error};
use crate::conversation::{self, ConversationStore, open_store};
use crate::plugin::bindings::shallot::filter::memory;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::convert;
use crate::store::StoreSpec;
use crate::types::{Call, Weigh};

/// The longest conversation id, in bytes.
const CONVERSATION_ID_CAP: usize = 512;
/// Conversation-store operations one call may make.
const STORE_OPS_PER_CALL: u32 = 64;

/// The `memory` service: its grant opens a conversation store.
pub(crate) struct Memory;

impl Service for Memory {
    const IMPORT: &'static str = "memory";
    const CALLED: &'static str = "memory";
    const CALLS: &'static [Call] = AROUND;
    const GRANT: &'static str = "memory = \"conversations.db\"";
    type Granted = Arc<dyn ConversationStore>;
    /// Operations made.
    type Spent = u32;

    fn granted(services: &GrantedServices) -> Option<&Self::Granted> {
        services.memory.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut u32 {
        &mut spent.memory
    }
}

/// What `grants.memory` opens: its store.
pub(super) async fn open(
    spec: Option<&StoreSpec>,
) -> Result<Option<Arc<dyn ConversationStore>>, String> {
    match spec {
        None => Ok(None),
        Some(spec) => Ok(Some(open_store(spec.clone()).await?)),
    }
}

impl HostState {
    /// The store, if granted, for one more operation of this call, with
    /// the conversation key checked.
    fn store(
        &mut self,
        conversation: &str,
    ) -> Result<Arc<dyn ConversationStore>, wit::FilterError> {
        let store = self.admit::<Memory>()?;
        if conversation.is_empty() || conversation.len() > CONVERSATION_ID_CAP {
            let message = format!("a conversation id must be 1 to {CONVERSATION_ID_CAP} bytes");
            return Err(error(wit::ErrorKind::InvalidRequest, message));
        }
        // Behind client keys an invoke is for one owner (the key's tenant,
        // else the key): its filters keep that owner's conversations only,
        // in its part of the store, as the gateway names them.
        if let Some(owner) = self.owner()
            && conversation::part(conversation) != owner
        {
            let message = format!(
                "a conversation of another owner: this invoke keeps only those whose id starts `{owner}/` (its `conversation_id` does)"
            );
            return Err(error(wit::ErrorKind::InvalidRequest, message));
        }
        let ops = self.spent::<Memory>();
        *ops += 1;
        if *ops > STORE_OPS_PER_CALL {
            let message =
                format!("more than {STORE_OPS_PER_CALL} conversation-store operations in one call");
            return Err(error(wit::ErrorKind::LimitExceeded, message));
        }
        Ok(store)
    }

    /// The most a conversation load hands the filter: half its free host
    /// memory, so that it can still pass what it loaded on (a request
    /// carrying the history is held in the host too).
    fn load_room(&self) -> usize {
        self.limits.host_bytes().saturating_sub(self.holding()) / 2
    }
}

impl memory::Host for HostState {
    async fn load(
        &mut self,
        conversation: String,
    ) -> wasmtime::Result<Result<Vec<wit::Message>, wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        let room = self.load_room();
        let messages = match self.on_store(store.load(&conversation, room)).await {
            Ok(messages) => messages,
            Err(e) => return Ok(Err(e)),
        };
        // The store measured its own form; what the filter is handed is
        // held in the host's: the oldest go until that fits too.
        let mut weight: usize = messages.iter().map(Weigh::weight).sum();
        let dropped = messages
            .iter()
            .take_while(|message| {
                let over = weight > room;
                if over {
                    weight -= message.weight();
                }
                over
            })
            .count();
        Ok(Ok(convert::messages(&messages[dropped..])))
    }

    async fn append(
        &mut self,
        conversation: String,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        let messages = convert::from_messages(messages);
        // What one call writes is bounded like what it makes the host
        // hold, as the store keeps it (its encoding can be several times
        // what the guest handed over), so a loop cannot flood the store.
        let stored = conversation::stored_size(&conversation, &messages);
        if let Err(refused) = self.write_to_stores(stored) {
            return Ok(Err(refused));
        }
        Ok(self.on_store(store.append(&conversation, &messages)).await)
    }

    async fn clear(
        &mut self,
        conversation: String,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        Ok(self.on_store(store.clear(&conversation)).await)
    }
}
