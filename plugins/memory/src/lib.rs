//! `memory` (chat): conversation history in the operator's store, by the
//! shared context's `conversation_id` (PEER-CASES M). Before each model
//! call it stores what is new in the request, loads the whole
//! conversation and sends that instead (cut to a window, if configured);
//! after it, it stores the model's reply. Without a conversation id it
//! passes through.
//!
//! What was stored is counted in the filter's private context, which
//! spans the invoke: the next round of the tool loop stores only the tool
//! results the reply asked for, and a turn filter's re-entry (the run's
//! messages plus feedback) only the feedback, so nothing is stored twice.
//!
//! The store is the host's, granted with `grants = { memory = "..." }`.
//! Put `memory` first among the chat filters, and run the tool loop
//! without its own history (`shallot chat` and `shallot serve` do so when
//! a filter is granted a store).
//!
//! Config: `{"window": 20, "conversation_key": "conversation_id"}` (both
//! optional; no window by default).

use serde::{Deserialize, Serialize};
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Message, Next, Role, context, memory,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Memory {
    /// The non-system messages sent to the model: the latest `window`
    /// (all system messages are kept, first). None: everything stored.
    window: Option<usize>,
    #[serde(default = "default_key")]
    conversation_key: String,
}

fn default_key() -> String {
    "conversation_id".to_owned()
}

/// How many of this invoke's request messages are stored already.
#[derive(Serialize, Deserialize, Default)]
struct Stored {
    messages: usize,
}

/// The messages the model sees of `history`: every system message, then
/// the latest `window` others, without tool results cut from their call.
fn windowed(history: Vec<Message>, window: Option<usize>) -> Vec<Message> {
    let Some(window) = window else {
        return history;
    };
    let (mut kept, rest): (Vec<Message>, Vec<Message>) =
        history.into_iter().partition(|m| m.role == Role::System);
    let recent = rest
        .into_iter()
        .rev()
        .take(window)
        .collect::<Vec<_>>()
        .into_iter()
        .rev();
    kept.extend(recent.skip_while(|m| m.role == Role::Tool));
    kept
}

#[shallot_guest::filter(name = "memory")]
impl Filter for Memory {
    type State = Stored;

    fn configure(&mut self) -> Result<(), String> {
        if self.window == Some(0) {
            return Err("window must be at least 1 (leave it out for no window)".to_owned());
        }
        Ok(())
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Stored>,
    ) -> Result<ChatResponse, FilterError> {
        let fctx = next.fctx();
        let Some(conversation) = context::get::<String>(&self.conversation_key) else {
            return next.chat(request);
        };
        let messages = request.messages();
        let stored = fctx.get().messages.min(messages.len());
        memory::append(&conversation, &messages[stored..])?;
        let history = memory::load(&conversation)?;
        request.set_messages(&windowed(history, self.window));
        let response = next.chat(request)?;
        let reply = response.message();
        let mut counted = messages.len();
        if reply.content.is_some() || !reply.tool_calls.is_empty() {
            memory::append(&conversation, &[reply])?;
            counted += 1;
        }
        fctx.set(&Stored { messages: counted });
        Ok(response)
    }
}
