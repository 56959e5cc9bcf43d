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
//! "on": ["transient", "timeout"]}` (all optional).

use std::hash::{BuildHasher, RandomState};

use serde::Deserialize;
use shallot_guest::{
    ErrorKind, Fctx, Filter, FilterError, ToolRequest, ToolResponse, log, next, timer,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolRetry {
    #[serde(default = "default_retries")]
    max_retries: u32,
    #[serde(default = "default_initial")]
    initial_delay_ms: u32,
    #[serde(default = "default_max_delay")]
    max_delay_ms: u32,
    #[serde(default)]
    backoff: Backoff,
    #[serde(default = "default_multiplier")]
    multiplier: f64,
    #[serde(default = "default_jitter")]
    jitter: f64,
    #[serde(default = "default_on")]
    on: Vec<Kind>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Backoff {
    #[default]
    Exponential,
    Linear,
    Constant,
}

/// An error kind, as the operator names it.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Kind {
    Transient,
    Timeout,
    InvalidRequest,
    NotFound,
    Auth,
    LimitExceeded,
    PluginFault,
    Internal,
    ContentFiltered,
}

impl Kind {
    fn of(kind: ErrorKind) -> Kind {
        match kind {
            ErrorKind::Transient => Kind::Transient,
            ErrorKind::Timeout => Kind::Timeout,
            ErrorKind::InvalidRequest => Kind::InvalidRequest,
            ErrorKind::NotFound => Kind::NotFound,
            ErrorKind::Auth => Kind::Auth,
            ErrorKind::LimitExceeded => Kind::LimitExceeded,
            ErrorKind::PluginFault => Kind::PluginFault,
            ErrorKind::Internal => Kind::Internal,
            ErrorKind::ContentFiltered => Kind::ContentFiltered,
        }
    }
}

fn default_retries() -> u32 {
    3
}
fn default_initial() -> u32 {
    200
}
fn default_max_delay() -> u32 {
    5000
}
fn default_multiplier() -> f64 {
    2.0
}
fn default_jitter() -> f64 {
    0.25
}
fn default_on() -> Vec<Kind> {
    vec![Kind::Transient, Kind::Timeout]
}

impl ToolRetry {
    /// The wait before retry `n` (1-based), jittered by up to `jitter` of
    /// it either way, never past `max_delay_ms`.
    fn delay(&self, n: u32) -> u32 {
        let base = f64::from(self.initial_delay_ms);
        let delay = match self.backoff {
            Backoff::Exponential => base * self.multiplier.powi(n as i32 - 1),
            Backoff::Linear => base * f64::from(n),
            Backoff::Constant => base,
        };
        let spread = RandomState::new().hash_one(n) as f64 / u64::MAX as f64 * 2.0 - 1.0;
        let jittered = delay * (1.0 + self.jitter * spread);
        jittered.clamp(0.0, f64::from(self.max_delay_ms)) as u32
    }
}

#[shallot_guest::filter(name = "tool-retry")]
impl Filter for ToolRetry {
    fn configure(&mut self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err("jitter must be between 0 and 1".to_owned());
        }
        if !(self.multiplier >= 1.0 && self.multiplier.is_finite()) {
            return Err("multiplier must be at least 1".to_owned());
        }
        if self.initial_delay_ms > self.max_delay_ms {
            return Err("initial_delay_ms must not be more than max_delay_ms".to_owned());
        }
        Ok(())
    }

    fn wants(&self, _: shallot_guest::Hook) -> bool {
        self.max_retries > 0
    }

    fn around_tool(
        &self,
        request: &ToolRequest,
        _: &Fctx<()>,
    ) -> Result<ToolResponse, FilterError> {
        let mut error = match next::tool(request) {
            Ok(response) => return Ok(response),
            Err(error) => error,
        };
        for attempt in 1..=self.max_retries {
            if !self.on.contains(&Kind::of(error.kind)) {
                break;
            }
            let delay = self.delay(attempt);
            log::info(&format!(
                "tool {} failed ({}: {}); retry {attempt} of {} in {delay} ms",
                request.name(),
                error.kind.as_str(),
                error.message,
                self.max_retries
            ));
            if delay > 0
                && let Err(cannot) = timer::sleep(delay)
            {
                log::warn(&format!(
                    "cannot wait before retrying, so not retrying: {}",
                    cannot.message
                ));
                break;
            }
            error = match next::tool(request) {
                Ok(response) => return Ok(response),
                Err(error) => error,
            };
        }
        Err(error)
    }
}
