//! End-to-end tests: real `.wasm` guests (the built-in plugins and the test
//! guests under tests/guests) through the real host. A test marked
//! `// PEER-CASES B1` ports that case of the peer's behaviour catalogue
//! (docs/PEER-CASES.md, which ends with a table from each case to its test).
//!
//! Build the guests first: `cargo build-guests`.

mod access;
mod agent;
mod apis;
mod approval;
mod audit;
mod chain;
mod concurrency;
mod context;
mod fctx;
mod fuzz;
mod gateway;
mod granted;
mod guards;
mod hostile;
mod identity;
mod loading;
mod logging;
mod mcp;
mod mcp_gateway;
mod memory;
mod polyglot;
mod presets;
mod provider;
mod resilience;
mod sandbox;
mod schema;
mod sdk;
mod soak;
mod spend;
mod stores;
mod stream_filters;
mod system_prompt;
mod tokens;
mod tool_search;
mod tools;
mod turn;
mod upstreams;
mod windows;
