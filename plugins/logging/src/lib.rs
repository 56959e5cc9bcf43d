//! `logging`: a pair of debug log lines around every chat, tool and turn
//! call. It never changes anything. Put it first to see the whole picture,
//! or after a filter to see only what that filter passes inward.
//!
//! Shown by `shallot -vv`, or `RUST_LOG=shallot::filter=debug`.

use serde::Deserialize;
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Next, ToolRequest, ToolResponse, TurnRequest,
    TurnResult, log,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Logging {}

fn failed(what: &str, error: &FilterError) {
    log::debug(&format!("{what} failed: {}", error.message));
}

#[shallot_guest::filter(name = "logging")]
impl Filter for Logging {
    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        log::debug(&format!("chat: {} messages", request.message_count()));
        let result = next.chat(request);
        match &result {
            Ok(response) => log::debug(&format!(
                "chat done: finish reason {}, {} tool calls",
                response.finish_reason().as_str(),
                response.message().tool_calls.len()
            )),
            Err(error) => failed("chat", error),
        }
        result
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        let name = request.name();
        log::debug(&format!("tool: {name}({})", request.arguments()));
        let result = next.tool(request);
        match &result {
            Ok(_) => log::debug(&format!("tool {name} done")),
            Err(error) => failed(&format!("tool {name}"), error),
        }
        result
    }

    fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
        log::debug(&format!("turn: {} new messages", request.message_count()));
        let result = next.turn(request);
        match &result {
            TurnResult::Done(done) => log::debug(&format!(
                "turn done: {} tool calls, {} model rounds",
                done.tool_calls().len(),
                done.iterations()
            )),
            TurnResult::Interrupt(interrupt) => {
                log::debug(&format!("turn interrupted: {}", interrupt.reason()))
            }
            TurnResult::Error(error) => failed("turn", error),
        }
        result
    }
}
