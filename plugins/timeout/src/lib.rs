//! `timeout` (tool): bounds each tool call with `next.tool-within`. Past
//! the deadline the inner call is cancelled and the call fails with a
//! `timeout` error; an inner failure before the deadline keeps its own
//! kind, message and origin (the peer's filter turned every failure into
//! its own).
//!
//! Config: `{"timeout_ms": 5000}` (required, greater than 0).

use serde::Deserialize;
use shallot_guest::{Filter, FilterError, Next, ToolRequest, ToolResponse};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Timeout {
    timeout_ms: u32,
}

#[shallot_guest::filter(name = "timeout")]
impl Filter for Timeout {
    fn configure(&mut self) -> Result<(), String> {
        if self.timeout_ms == 0 {
            return Err("timeout_ms must be greater than 0".to_owned());
        }
        Ok(())
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        next.tool_within(request, self.timeout_ms)
    }
}
