//! The host's own types for what flows through the chains: messages, the
//! requests and responses of the chat, tool and turn chains, tokens, and
//! the typed errors they carry (re-exported at the crate root).
//!
//! These are what embedders and terminals use. The WIT types a filter sees
//! are converted to and from them in one place, `plugin::convert`.
//! Big parts (message lists, tool arguments) sit behind `Arc` so that a
//! layer hands a request inward without copying it; a change copies only
//! what it touches.

mod chat;
mod embedding;
pub(crate) mod error;
mod message;
mod options;
mod token;
mod tool;
mod turn;
mod weight;

pub use chat::{ChatRequest, ChatResponse, FinishReason, ResponseLimits, Usage};
pub use embedding::{
    Embedding, EmbeddingInput, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, EncodingFormat,
    Vector,
};
pub(crate) use error::{Call, Cause, ChainError, ErrorKind, Origin};
pub use message::{Content, ContentPart, Message, Role, ToolCall};
pub use options::{ModelOptions, Stop, ToolChoice};
pub use token::{Token, TokenBatch};
pub use tool::{ToolKind, ToolRequest, ToolResponse, ToolSpec};
pub(crate) use turn::{Carried, Resumable};
pub use turn::{
    Decision, InterruptKind, ToolCallRecord, TurnDone, TurnInterrupt, TurnRequest, TurnResult,
};
pub(crate) use weight::{Weigh, json_weight};

/// A JSON object, for options and metadata.
pub type JsonMap = serde_json::Map<String, serde_json::Value>;
