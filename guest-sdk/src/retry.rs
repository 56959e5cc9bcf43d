//! Calling the inner layer again when it failed for a passing reason,
//! waiting longer each time: the built-in `tool-retry` and `model-retry`
//! filters are this policy around `next`, and so can a filter of yours be.
//!
//! [`Retry`] is the policy as an operator configures it (every option has
//! a default, per filter through [`Defaults`]); [`Retry::run`] calls until
//! a call works, fails with an error kind not in `on`, or the retries run
//! out, and then returns the last failure as it was (its origin kept).
//! Waiting needs the host's `timer` (`grants = { sleep_ms = … }`); a wait
//! the grant does not cover ends the retries.
//!
//! ```no_run
//! use serde::Deserialize;
//! use shallot_guest::{Filter, FilterError, Next, TurnRequest, TurnResult, retry};
//!
//! /// Retries a whole turn at once, at most twice by default.
//! struct TurnDefaults;
//!
//! impl retry::Defaults for TurnDefaults {
//!     const MAX_RETRIES: u32 = 2;
//!     const INITIAL_DELAY_MS: u32 = 0;
//!     const MAX_DELAY_MS: u32 = 0;
//! }
//!
//! #[derive(Deserialize)]
//! #[serde(transparent)]
//! struct TurnRetry(retry::Retry<TurnDefaults>);
//!
//! #[shallot_guest::filter(name = "turn-retry")]
//! impl Filter for TurnRetry {
//!     fn configure(&mut self) -> Result<(), String> {
//!         self.0.check()
//!     }
//!
//!     fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
//!         let run = self.0.run("the turn", || match next.turn(request) {
//!             TurnResult::Error(error) => Err(error),
//!             other => Ok(other),
//!         });
//!         run.unwrap_or_else(TurnResult::Error)
//!     }
//! }
//! ```

use std::hash::{BuildHasher, RandomState};
use std::marker::PhantomData;

use serde::Deserialize;

use crate::{ErrorKind, FilterError, log, timer};

/// A filter's defaults for the options of its [`Retry`] policy.
pub trait Defaults {
    /// Retries after the first attempt.
    const MAX_RETRIES: u32 = 3;
    /// The first wait, in milliseconds.
    const INITIAL_DELAY_MS: u32;
    /// The longest wait, in milliseconds.
    const MAX_DELAY_MS: u32;
}

/// A retry policy, as configuration gives it: `{"max_retries": 3,
/// "initial_delay_ms": …, "max_delay_ms": …, "backoff": "exponential",
/// "multiplier": 2.0, "jitter": 0.25, "on": ["transient", "timeout"]}`,
/// every option optional, unknown ones refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, bound = "")]
pub struct Retry<D: Defaults> {
    /// Retries after the first attempt.
    #[serde(default = "max_retries::<D>")]
    pub max_retries: u32,
    /// The first wait.
    #[serde(default = "initial_delay_ms::<D>")]
    pub initial_delay_ms: u32,
    /// The longest wait.
    #[serde(default = "max_delay_ms::<D>")]
    pub max_delay_ms: u32,
    /// How the wait grows from one retry to the next.
    #[serde(default)]
    pub backoff: Backoff,
    /// Growth per retry (exponential); at least 1.
    #[serde(default = "multiplier")]
    pub multiplier: f64,
    /// The random spread of each wait, a fraction of it (0 to 1).
    #[serde(default = "jitter")]
    pub jitter: f64,
    /// The error kinds worth a retry.
    #[serde(default = "passing")]
    pub on: Vec<Kind>,
    #[serde(skip)]
    defaults: PhantomData<D>,
}

/// How the wait before retry `n` grows.
#[derive(Deserialize, Default, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Backoff {
    /// `initial_delay_ms × multiplier^(n-1)`.
    #[default]
    Exponential,
    /// `initial_delay_ms × n`.
    Linear,
    /// `initial_delay_ms`.
    Constant,
}

/// An error kind as configuration names it (`"transient"`,
/// `"not-found"`, …).
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Transient,
    Timeout,
    ContentFiltered,
    InvalidRequest,
    Auth,
    NotFound,
    LimitExceeded,
    PluginFault,
    Internal,
}

impl Kind {
    /// The configuration's name for `kind`.
    pub fn of(kind: ErrorKind) -> Kind {
        match kind {
            ErrorKind::Transient => Kind::Transient,
            ErrorKind::Timeout => Kind::Timeout,
            ErrorKind::ContentFiltered => Kind::ContentFiltered,
            ErrorKind::InvalidRequest => Kind::InvalidRequest,
            ErrorKind::Auth => Kind::Auth,
            ErrorKind::NotFound => Kind::NotFound,
            ErrorKind::LimitExceeded => Kind::LimitExceeded,
            ErrorKind::PluginFault => Kind::PluginFault,
            ErrorKind::Internal => Kind::Internal,
        }
    }
}

fn max_retries<D: Defaults>() -> u32 {
    D::MAX_RETRIES
}
fn initial_delay_ms<D: Defaults>() -> u32 {
    D::INITIAL_DELAY_MS
}
fn max_delay_ms<D: Defaults>() -> u32 {
    D::MAX_DELAY_MS
}
fn multiplier() -> f64 {
    2.0
}
fn jitter() -> f64 {
    0.25
}
fn passing() -> Vec<Kind> {
    vec![Kind::Transient, Kind::Timeout]
}

impl<D: Defaults> Retry<D> {
    /// Refuses a policy that cannot work: a jitter outside 0..1, a
    /// multiplier under 1, a first wait over the longest.
    pub fn check(&self) -> Result<(), String> {
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

    /// The wait before retry `n` (1-based), jittered by up to `jitter` of
    /// it either way, never past `max_delay_ms`.
    pub fn delay(&self, n: u32) -> u32 {
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

    /// Calls `call` until it works, fails with a kind not in `on`, or the
    /// retries run out; the last failure is returned as it was. Each retry
    /// is logged at `info`, naming the call `what`.
    pub fn run<T>(
        &self,
        what: &str,
        mut call: impl FnMut() -> Result<T, FilterError>,
    ) -> Result<T, FilterError> {
        let mut error = match call() {
            Ok(done) => return Ok(done),
            Err(error) => error,
        };
        for attempt in 1..=self.max_retries {
            if !self.on.contains(&Kind::of(error.kind)) {
                break;
            }
            let delay = self.delay(attempt);
            log::info(&format!(
                "{what} failed ({}: {}); retry {attempt} of {} in {delay} ms",
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
            error = match call() {
                Ok(done) => return Ok(done),
                Err(error) => error,
            };
        }
        Err(error)
    }
}
