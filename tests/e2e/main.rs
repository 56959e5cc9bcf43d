//! End-to-end tests: real `.wasm` guests (the built-in plugins and the test
//! guests under tests/guests) through the real host. Cases named `b1_...`,
//! `i8_...` port the peer's behaviour catalogue (docs/PEER-CASES.md).
//!
//! Build the guests first: `cargo build-guests`.

mod agent;
mod approval;
mod builtins;
mod chain;
mod concurrency;
mod context;
mod fctx;
mod fuzz;
mod gateway;
mod granted;
mod hostile;
mod library;
mod loading;
mod memory;
mod polyglot;
mod provider;
mod sandbox;
mod schema;
mod sdk;
mod soak;
mod system_prompt;
mod tokens;
mod tool_search;
mod tools;
mod turn;
