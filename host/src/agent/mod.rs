//! The agent: the tool loop that is the turn chain's terminal, and the
//! conversation history it loads and appends to.
//!
//! A turn runs model rounds through the chat chain and the tools the model
//! asks for through the tool chain, all within one invoke, so every filter
//! sees the whole turn with one private context.
//!
//! A turn with a native tool whose arguments are checked against its JSON
//! Schema before it runs, a tool that needs a human's approval, and a
//! system prompt, against an OpenAI-compatible server:
//!
//! ```no_run
//! use serde_json::{Value, json};
//! use shallot::types::{Decision, Message, ToolSpec, TurnRequest, TurnResult};
//! use shallot::{Context, InvokeOptions, Kernel, LoopConfig, MemoryHistory};
//! use shallot::{OpenAiConfig, OpenAiModel, ToolLoop};
//!
//! # async fn run() -> anyhow::Result<()> {
//! let model = OpenAiModel::new(OpenAiConfig::new("http://localhost:11434/v1", "qwen2.5:7b"))?;
//! let weather = ToolSpec::new(
//!     "weather",
//!     "today's weather in a city",
//!     json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
//! );
//! let transfer = ToolSpec::new("transfer", "moves money", json!({"type": "object"})).sensitive();
//! let config = LoopConfig { pause_sensitive: true, ..LoopConfig::default() };
//! let kernel = Kernel::builder()
//!     .model(model)
//!     .tool(weather, |args: Value, _| async move { Ok(json!({"city": args["city"], "sky": "clear"})) })
//!     .tool(transfer, |_: Value, _| async move { Ok(json!("done")) })
//!     .builtin_tools()
//!     .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
//!     .build()?;
//! let options = || {
//!     InvokeOptions::from(Context::new().with("conversation_id", "c1")).system_prompt("Be terse.")
//! };
//! let mut result = kernel.turn(TurnRequest::new(vec![Message::user("Pay Bob 5 EUR")]), options()).await;
//! // A sensitive tool paused the turn: approve it (a denial reaches the model as the tool's result).
//! if let TurnResult::Interrupt(paused) = result {
//!     result = kernel.resume(paused, Decision::Approve, options()).await;
//! }
//! match result {
//!     TurnResult::Done(done) => println!("{}", done.response.text()),
//!     TurnResult::Interrupt(paused) => println!("paused again: {}", paused.reason),
//!     TurnResult::Error(error) => eprintln!("{error}"),
//! }
//! # Ok(())
//! # }
//! ```

mod history;
mod tool_loop;

pub use history::{History, MemoryHistory, NoHistory};
pub use tool_loop::{LoopConfig, OnEnvError, ToolLoop};
