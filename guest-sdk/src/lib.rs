//! Write [shallot] filters in Rust.
//!
//! A filter is one layer of an onion around a model call (chat), a tool
//! execution (tool) and a whole agent turn (turn), plus an optional
//! streaming token transform. Implement [`Filter`] for your configuration
//! type, override the hooks you need (every other hook passes through), and
//! put `#[shallot_guest::filter]` on the impl block. Build the crate as a
//! `cdylib` for `wasm32-wasip2` and drop the `.wasm` into shallot's plugins
//! directory.
//!
//! Besides [`next`], [`Fctx`], [`context`] and [`log`], a filter the
//! operator grants them can use host services: [`timer`] (sleep, for a
//! backoff), [`approval`] (ask the host's approval handler), [`trace`]
//! (JSON lines to the operator's sink), [`memory`] (a conversation
//! store), [`kv`] (keys kept across invokes) and [`model`] (side calls to a
//! model, outside the onion); without the grant each call returns an
//! `auth` error naming it. Outgoing HTTP is the standard `wasi:http`
//! client (`grants.http`): use a wasi HTTP crate such as `wstd`.
//! [`validate::reenter`] runs a turn until a check passes, and
//! [`HeldTokens`] holds a stream's tokens back, to release or drop when the
//! stream ends ([`TokenTransform::flush`] is told why it did).
//!
//! This crate owns the guest side of the `shallot:filter` WIT contract; it
//! must not grow host logic: the host owns ordering, private state (FCtx)
//! storage, limits and errors attribution.
//!
//! # Example: block a word, count calls in FCtx, mask digits while streaming
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use shallot_guest::{
//!     ChatRequest, ChatResponse, Filter, FilterError, FinishReason, Message, Next, TokenOut,
//!     TokenTransform, Tokens, log,
//! };
//!
//! /// The configuration the operator gives, e.g. `{"word": "bomb"}`.
//! #[derive(Deserialize)]
//! struct Guard {
//!     word: String,
//! }
//!
//! /// Private per-invoke state: survives every round of the tool loop.
//! #[derive(Serialize, Deserialize, Default)]
//! struct Calls {
//!     n: u32,
//! }
//!
//! #[shallot_guest::filter]
//! impl Filter for Guard {
//!     type State = Calls;
//!
//!     fn around_chat(&self, req: &ChatRequest, next: Next<Calls>) -> Result<ChatResponse, FilterError> {
//!         let fctx = next.fctx();
//!         fctx.update(|calls| calls.n += 1);
//!         let asked = req.messages().iter().any(|m| m.text().contains(&self.word));
//!         if asked {
//!             // Short-circuit: the model is never called.
//!             return Ok(ChatResponse::new(&Message::assistant("I can't help with that."), FinishReason::ContentFiltered));
//!         }
//!         let response = next.chat(req)?;
//!         log::debug(&format!("model answered, call #{} of this invoke", fctx.get().n));
//!         Ok(response)
//!     }
//!
//!     fn token_transform(&self) -> Box<dyn TokenTransform> {
//!         Box::new(MaskDigits)
//!     }
//! }
//!
//! struct MaskDigits;
//!
//! impl TokenTransform for MaskDigits {
//!     fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
//!         for token in tokens.iter() {
//!             let masked: String = token.text.chars().map(|c| if c.is_ascii_digit() { '#' } else { c }).collect();
//!             out.push(&masked, token.meta);
//!         }
//!         Ok(())
//!     }
//! }
//! ```
//!
//! [shallot]: https://github.com/shallot-rs/shallot

extern crate self as shallot_guest;

pub mod context;
mod error;
mod fctx;
mod filter;
pub mod glob;
mod granted;
pub mod log;
mod next;
pub mod retry;
mod tokens;
mod types;
pub mod validate;

#[doc(hidden)]
pub mod __private;

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "filter",
        path: "../wit",
        pub_export_macro: true,
        export_macro_name: "__export_filter_world",
        default_bindings_module: "shallot_guest::bindings",
        runtime_path: "shallot_guest::__private::wit_bindgen::rt",
    });
}

pub use bindings::exports::shallot::filter::plugin::Hook;
pub use bindings::shallot::filter::types::{
    ChatRequest, ChatResponse, Content, ContentPart, ErrorKind, FinishReason, Image, Message, Role,
    ToolCall, ToolCallRecord, ToolKind, ToolRequest, ToolResponse, ToolSpec, TurnDone,
    TurnInterrupt, TurnRequest, Usage,
};
pub use error::{FilterError, TurnResult};
pub use fctx::Fctx;
pub use filter::Filter;
pub use granted::{approval, kv, memory, metrics, model, timer, trace};
pub use next::Next;
pub use shallot_guest_macro::{around_chat, around_tool, around_turn, filter};
pub use tokens::{HeldTokens, PassThrough, Token, TokenOut, TokenTransform, Tokens};
