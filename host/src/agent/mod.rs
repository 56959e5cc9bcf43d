//! The agent: the tool loop that is the turn chain's terminal, and the
//! conversation history it loads and appends to.
//!
//! A turn runs model rounds through the chat chain and the tools the model
//! asks for through the tool chain, all within one invoke, so every filter
//! sees the whole turn with one private context.

mod history;
mod tool_loop;

pub use history::{History, MemoryHistory};
pub(crate) use tool_loop::Paused;
pub use tool_loop::{CONVERSATION_ID, Decision, LoopConfig, ToolLoop};
