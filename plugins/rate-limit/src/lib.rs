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
//! on a refusal, `Retry-After`. Tokens are held before each model call
//! (its messages' text at four bytes a token, plus its `max_tokens`) and
//! settled with the usage the model reports after it, so that calls in
//! flight count and a stream cut short is charged what was held; a request
//! is refused once the window's tokens are spent or held. A request that
//! fails gives its tokens back, and its place in the window too unless its
//! client got it wrong (`invalid-request`, `content-filtered`, `auth`,
//! `not-found` still count).
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
//! `on_store_error` (`closed`, or `open`) says what a request gets while
//! the store fails: refused, or let through uncounted. An answer already
//! made is delivered whatever the store does (a count it cannot take is
//! logged as owed).

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use shallot_guest::kv::OnStoreError;
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
    /// What a request gets while the store fails: refused (`closed`), or
    /// let through uncounted (`open`).
    #[serde(default = "closed")]
    on_store_error: OnStoreError,
}

fn closed() -> OnStoreError {
    OnStoreError::Closed
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

    /// Counts the request and holds `reserve` tokens for it (what its
    /// model call may use); refuses it, all or nothing, past the limits.
    /// What it saw goes to the shared context either way.
    fn admit(&self, reserve: u64) -> Result<Taken, FilterError> {
        let bucket = self.bucket();
        let mut taken = Taken::default();
        let mut refused = None;
        if let Some(limit) = self.requests.map(u64::from) {
            let slot = self.window("requests", &bucket)?;
            let count = kv::add(&slot.key, 1, slot.ttl_ms)?;
            let used = slot.carried + count.value.max(0) as u64;
            let reset_ms = slot.reset_ms.unwrap_or(count.ttl_ms);
            if used > limit {
                refused = Some(("requests", limit, reset_ms));
            }
            context::report_limit("requests", limit, limit.saturating_sub(used), reset_ms);
            taken.request = Some(Held::of(slot, 1));
        }
        if let Some(limit) = self.tokens {
            let slot = self.window("tokens", &bucket)?;
            let count = kv::add(&slot.key, reserve as i64, slot.ttl_ms)?;
            // What others used and hold: the window is spent when that is.
            let used = (slot.carried + count.value.max(0) as u64).saturating_sub(reserve);
            let reset_ms = slot.reset_ms.unwrap_or(count.ttl_ms);
            if used >= limit && refused.is_none() {
                refused = Some(("tokens", limit, reset_ms));
            }
            context::report_limit("tokens", limit, limit.saturating_sub(used), reset_ms);
            taken.tokens = Some(Held::of(slot, reserve));
        }
        let Some((what, limit, reset_ms)) = refused else {
            return Ok(taken);
        };
        // A refused request is not one of the window's.
        taken.give_back();
        Err(FilterError::new(
            ErrorKind::LimitExceeded,
            format!(
                "rate limit of {limit} {what} per {} s reached; retry in {} s",
                self.window_s,
                reset_ms.div_ceil(1000)
            ),
        ))
    }

    /// Admits the request (or refuses it); while the store fails, as
    /// `on_store_error` says (let through, nothing taken).
    fn admitted(&self, reserve: u64) -> Result<Taken, FilterError> {
        Ok(self
            .on_store_error
            .tolerate(self.admit(reserve), "rate-limit")?
            .unwrap_or_default())
    }

    /// Holds `reserve` tokens for a model call of a turn already admitted
    /// (no refusal: the turn was let in).
    fn hold(&self, reserve: u64) -> Taken {
        if self.tokens.is_none() {
            return Taken::default();
        }
        let slot = self.window("tokens", &self.bucket());
        let held = slot.and_then(|slot| {
            kv::add(&slot.key, reserve as i64, slot.ttl_ms)?;
            Ok(Held::of(slot, reserve))
        });
        match held {
            Ok(held) => Taken {
                request: None,
                tokens: Some(held),
            },
            Err(e) => {
                shallot_guest::log::warn(&format!(
                    "rate-limit: {reserve} tokens not held, the call goes on: {}",
                    e.message
                ));
                Taken::default()
            }
        }
    }

    /// Settles the tokens an answer used against what was held for it:
    /// the answer is delivered whatever the store does, and a count it
    /// cannot take is logged as owed.
    fn spent(&self, taken: &Taken, response: &ChatResponse) {
        if self.tokens.is_none() {
            return;
        }
        let used = u64::from(response.usage().total_tokens);
        if let Some(held) = &taken.tokens {
            held.settle(used);
            return;
        }
        if used == 0 {
            return;
        }
        match self.window("tokens", &self.bucket()) {
            Ok(slot) => {
                kv::charge(&slot.key, used as i64, slot.ttl_ms, "rate-limit");
            }
            Err(e) => shallot_guest::log::warn(&format!(
                "rate-limit: owed: {used} tokens not counted, the answer delivered: {}",
                e.message
            )),
        }
    }
}

/// Whether a request that failed with `error` is given back its place in
/// the window: one that failed through no fault of its client (the model
/// server, the host, a store, a later limit) is; one its client got wrong
/// (refused as invalid, filtered, unauthorized, naming nothing) still
/// counts, so that failing requests are not a free way to reach the model.
fn refunded(error: &FilterError) -> bool {
    !matches!(
        error.kind,
        ErrorKind::InvalidRequest
            | ErrorKind::ContentFiltered
            | ErrorKind::Auth
            | ErrorKind::NotFound
    )
}

/// What admitting a request took from its windows, kept until the request
/// ends: settled with what it used, or given back when it fails.
#[derive(Default)]
struct Taken {
    request: Option<Held>,
    tokens: Option<Held>,
}

impl Taken {
    /// Gives back all it took.
    fn give_back(&self) {
        for held in [&self.request, &self.tokens].into_iter().flatten() {
            held.settle(0);
        }
    }

    /// What the request's failure with `error` gives back: the tokens held
    /// for an answer that never came, and the request's place if
    /// [`refunded`].
    fn failed(&self, error: &FilterError) {
        if let Some(held) = &self.tokens {
            held.settle(0);
        }
        if let Some(held) = self.request.as_ref().filter(|_| refunded(error)) {
            held.settle(0);
        }
    }
}

/// An amount added to one window's counter.
struct Held {
    key: String,
    ttl_ms: u64,
    amount: u64,
}

impl Held {
    fn of(slot: Slot, amount: u64) -> Self {
        Held {
            key: slot.key,
            ttl_ms: slot.ttl_ms,
            amount,
        }
    }

    /// Makes what was added `used`: adds the difference (tried twice, a
    /// failure logged as owed).
    fn settle(&self, used: u64) {
        let delta = used as i64 - self.amount as i64;
        if delta != 0 {
            kv::charge(&self.key, delta, self.ttl_ms, "rate-limit");
        }
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
        let taken = match self.admitted(0) {
            Ok(taken) => taken,
            Err(refused) => return TurnResult::Error(refused),
        };
        next.fctx().set(&Counted { counted: true });
        let result = next.turn(request);
        if let TurnResult::Error(e) = &result {
            taken.failed(e);
        }
        result
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Counted>,
    ) -> Result<ChatResponse, FilterError> {
        let reserve = match self.tokens {
            Some(_) => u64::from(request.estimated_usage(0).total_tokens),
            None => 0,
        };
        let taken = if next.fctx().get().counted {
            self.hold(reserve)
        } else {
            self.admitted(reserve)?
        };
        match next.chat(request) {
            Ok(response) => {
                self.spent(&taken, &response);
                Ok(response)
            }
            Err(e) => {
                taken.failed(&e);
                Err(e)
            }
        }
    }
}
