//! `rate-limit` (turn, chat): requests and tokens per window, per client
//! key, tenant, user or any context key, counted in the `kv` grant's
//! store, so that gateways sharing one Redis share one limit.
//!
//! An invoke is one request: a turn counts once, however many model calls
//! its tool loop makes (a chat counts when no turn is around it). A
//! request over the limit is refused before anything runs, with a
//! `limit-exceeded` error saying when to retry; every request, refused or
//! not, leaves what it saw in the shared context's `rate_limit` key
//! (`{"requests": {"limit", "remaining", "reset_ms"}, "tokens": {...}}`),
//! which `shallot serve` answers as OpenAI's `x-ratelimit-*` headers and,
//! on a refusal, `Retry-After`. Tokens are the usage the model reports,
//! counted after each answer; a request is refused once the window's
//! tokens are spent.
//!
//! A `fixed` window is one counter per bucket that expires with its
//! window (one `kv.add`). A `sliding` window weighs the previous window's
//! count by how much of it still overlaps the last `window_s` seconds
//! (two operations), and needs `grants.clock`.
//!
//! Config: `{"requests": 60, "tokens": 100000, "window_s": 60, "window":
//! "fixed", "by": "key"}`: `requests` or `tokens` (or both); `by`
//! is the context key whose value is the bucket (`key`: the client key's name, `tenant`,
//! `user`, or any other); requests without it share one bucket.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Next, TurnRequest, TurnResult,
    context, kv,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimit {
    requests: Option<u32>,
    tokens: Option<u64>,
    #[serde(default = "default_window")]
    window_s: u32,
    #[serde(default)]
    window: Window,
    #[serde(default = "default_by")]
    by: String,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Window {
    #[default]
    Fixed,
    Sliding,
}

fn default_window() -> u32 {
    60
}

fn default_by() -> String {
    "key".to_owned()
}

/// Whether this invoke was counted already (by its turn).
#[derive(Serialize, Deserialize, Default)]
struct Counted {
    counted: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl RateLimit {
    fn window_ms(&self) -> u64 {
        u64::from(self.window_s) * 1000
    }

    /// The bucket this request counts in: the `by` key's value.
    fn bucket(&self) -> String {
        context::get_text(&self.by).unwrap_or_default()
    }

    /// The counter key of `what` in `bucket`, and the time its window has
    /// left; for a sliding window, the key of the window now and the
    /// weighted count of the one before.
    fn window(&self, what: &str, bucket: &str) -> Result<Slot, FilterError> {
        let name = format!("{what}:{}:{bucket}", self.by);
        if self.window == Window::Fixed {
            return Ok(Slot {
                key: name,
                ttl_ms: self.window_ms(),
                carried: 0,
                reset_ms: None,
            });
        }
        let (now, width) = (now_ms(), self.window_ms());
        let (index, into) = (now / width, now % width);
        let previous = match kv::get(&format!("{name}:{}", index.wrapping_sub(1)))? {
            Some(entry) => entry.value.parse::<u64>().unwrap_or(0),
            None => 0,
        };
        Ok(Slot {
            key: format!("{name}:{index}"),
            ttl_ms: 2 * width,
            carried: previous * (width - into) / width,
            reset_ms: Some(width - into),
        })
    }

    /// Counts the request; refuses it past the limits. What it saw goes
    /// to the shared context either way.
    fn admit(&self) -> Result<(), FilterError> {
        let bucket = self.bucket();
        let mut refused = None;
        if let Some(limit) = self.requests.map(u64::from) {
            let slot = self.window("requests", &bucket)?;
            let count = kv::add(&slot.key, 1, slot.ttl_ms)?;
            let used = slot.carried + count.value.max(0) as u64;
            let reset_ms = slot.reset_ms.unwrap_or(count.ttl_ms);
            if used > limit {
                // A refused request is not one of the window's.
                kv::add(&slot.key, -1, slot.ttl_ms)?;
                refused = Some(("requests", limit, reset_ms));
            }
            context::report_limit("requests", limit, limit.saturating_sub(used), reset_ms);
        }
        if let Some(limit) = self.tokens {
            let slot = self.window("tokens", &bucket)?;
            let count = kv::add(&slot.key, 0, slot.ttl_ms)?;
            let used = slot.carried + count.value.max(0) as u64;
            let reset_ms = slot.reset_ms.unwrap_or(count.ttl_ms);
            if used >= limit && refused.is_none() {
                refused = Some(("tokens", limit, reset_ms));
            }
            context::report_limit("tokens", limit, limit.saturating_sub(used), reset_ms);
        }
        match refused {
            None => Ok(()),
            Some((what, limit, reset_ms)) => Err(FilterError::new(
                ErrorKind::LimitExceeded,
                format!(
                    "rate limit of {limit} {what} per {} s reached; retry in {} s",
                    self.window_s,
                    reset_ms.div_ceil(1000)
                ),
            )),
        }
    }

    /// Counts the tokens an answer used.
    fn spent(&self, response: &ChatResponse) -> Result<(), FilterError> {
        if self.tokens.is_none() {
            return Ok(());
        }
        let used = response.usage().total_tokens;
        if used > 0 {
            let slot = self.window("tokens", &self.bucket())?;
            kv::add(&slot.key, used.into(), slot.ttl_ms)?;
        }
        Ok(())
    }
}

/// One window's counter.
struct Slot {
    key: String,
    ttl_ms: u64,
    /// The previous window's weighted count (sliding windows).
    carried: u64,
    /// When the window ends, where the counter's expiry does not say.
    reset_ms: Option<u64>,
}

#[shallot_guest::filter(name = "rate-limit")]
impl Filter for RateLimit {
    type State = Counted;

    fn configure(&mut self) -> Result<(), String> {
        if self.requests.is_none() && self.tokens.is_none() {
            return Err("rate-limit: give `requests`, `tokens` or both".into());
        }
        if self.window_s == 0 {
            return Err("rate-limit: `window_s` must be at least 1".into());
        }
        if self.window == Window::Sliding && now_ms() == 0 {
            return Err(
                "rate-limit: a sliding window reads the clock: grant it with `grants = { clock = true, kv = ... }`"
                    .into(),
            );
        }
        Ok(())
    }

    fn around_turn(&self, request: &TurnRequest, next: Next<Counted>) -> TurnResult {
        if let Err(refused) = self.admit() {
            return TurnResult::Error(refused);
        }
        next.fctx().set(&Counted { counted: true });
        next.turn(request)
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Counted>,
    ) -> Result<ChatResponse, FilterError> {
        if !next.fctx().get().counted {
            self.admit()?;
        }
        let response = next.chat(request)?;
        self.spent(&response)?;
        Ok(response)
    }
}
