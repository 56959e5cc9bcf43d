//! `tool-retry` (tool): calls a failed tool again when the failure is one
//! a retry can get past (by default `transient` and `timeout`), up to
//! `max_retries` times, waiting between attempts with exponential backoff
//! and jitter. When the retries run out, the last failure is returned as it
//! was (its origin kept); any other failure is returned at once.
//!
//! Waiting needs the host's `timer`, granted by the operator with
//! `grants = { sleep_ms = ... }` (the most one call may wait in all). A
//! wait the grant does not cover ends the retries: the last failure is
//! returned, and a warning says why. With `initial_delay_ms = 0` it
//! retries at once and needs no grant.
//!
//! Config: `{"max_retries": 3, "initial_delay_ms": 200, "max_delay_ms":
//! 5000, "backoff": "exponential", "multiplier": 2.0, "jitter": 0.25,
//! "on": ["transient", "timeout"]}` (all optional; see
//! `shallot_guest::retry`).

use serde::Deserialize;
use shallot_guest::retry::{Defaults, Retry};
use shallot_guest::{Filter, FilterError, Next, ToolRequest, ToolResponse};

struct ToolDefaults;

impl Defaults for ToolDefaults {
    const INITIAL_DELAY_MS: u32 = 200;
    const MAX_DELAY_MS: u32 = 5000;
}

#[derive(Deserialize)]
#[serde(transparent)]
struct ToolRetry(Retry<ToolDefaults>);

#[shallot_guest::filter(name = "tool-retry")]
impl Filter for ToolRetry {
    fn configure(&mut self) -> Result<(), String> {
        self.0.check()
    }

    fn wants(&self, _: shallot_guest::Hook) -> bool {
        self.0.max_retries > 0
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        let what = format!("tool {}", request.name());
        self.0.run(&what, || next.tool(request))
    }
}
