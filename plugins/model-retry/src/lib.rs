//! `model-retry` (chat): calls the inner layers again when a model call
//! failed for a passing reason (by default `transient` and `timeout`), up
//! to `max_retries` times, waiting between attempts with exponential
//! backoff and jitter (the seed's `model_retry`: 1 s, doubling, at most
//! 30 s). When the retries run out, the last failure is returned as it
//! was (its origin kept); any other failure is returned at once.
//!
//! Config: `{"max_retries": 3, "initial_delay_ms": 1000, "max_delay_ms":
//! 30000, "backoff": "exponential", "multiplier": 2.0, "jitter": 0.25,
//! "on": ["transient", "timeout"]}` (all optional; see
//! `shallot_guest::retry`). Waiting needs `grants = { sleep_ms = ... }`.

use serde::Deserialize;
use shallot_guest::retry::{Defaults, Retry};
use shallot_guest::{ChatRequest, ChatResponse, Filter, FilterError, Next};

struct ModelDefaults;

impl Defaults for ModelDefaults {
    const INITIAL_DELAY_MS: u32 = 1000;
    const MAX_DELAY_MS: u32 = 30_000;
}

#[derive(Deserialize)]
#[serde(transparent)]
struct ModelRetry(Retry<ModelDefaults>);

#[shallot_guest::filter(name = "model-retry")]
impl Filter for ModelRetry {
    fn configure(&mut self) -> Result<(), String> {
        self.0.check()
    }

    fn wants(&self, _: shallot_guest::Hook) -> bool {
        self.0.max_retries > 0
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        self.0.run("the model call", || next.chat(request))
    }
}
