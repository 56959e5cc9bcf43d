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
//! Every decision is one `kv.take`: the request's windows (its count,
//! its tokens) counted all or nothing, in one atomic operation on the
//! store's clock, so replicas sharing a Redis never disagree. A `fixed`
//! window starts with the first request that finds none and ends
//! `window_s` later; a `sliding` one weighs the previous window's count
//! (windows of `window_s` from the Unix epoch) by how much of it still
//! overlaps the last `window_s` seconds. What a call held is settled in
//! the window it was taken from, never in a later one.
//!
//! Config: `{"requests": 60, "tokens": 100000, "window_s": 60, "window":
//! "fixed", "by": "key"}`: `requests` or `tokens` (or both); `by`
//! is the context key whose value is the bucket (`key`: the client key's name, `tenant`,
//! `user`, or any other); requests without it share one bucket.
//! `on_store_error` (`closed`, or `open`) says what a request gets while
//! the store fails: refused, or let through uncounted. An answer already
//! made is delivered whatever the store does (a count it cannot take is
//! logged as owed).

use serde::{Deserialize, Serialize};
use shallot_guest::kv::{Hold, OnStoreError, Period};
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
    /// Several windows decided together (instead of the ones above).
    #[serde(default)]
    limits: Vec<Limit>,
    #[serde(default = "default_by")]
    by: String,
    /// What a request gets while the store fails: refused (`closed`), or
    /// let through uncounted (`open`).
    #[serde(default = "closed")]
    on_store_error: OnStoreError,
    /// The windows, once configured, each with the suffix of its keys.
    #[serde(skip)]
    spans: Vec<(Limit, String)>,
}

/// One window's limits.
#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Limit {
    requests: Option<u32>,
    tokens: Option<u64>,
    window_s: u32,
    #[serde(default)]
    window: Window,
}

/// The most windows of `limits`: each may count requests and tokens, and
/// one take counts in at most 8.
const LIMITS_CAP: usize = 4;

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
struct Turned {
    counted: bool,
}

impl Limit {
    fn period(&self) -> Period {
        let width = u64::from(self.window_s) * 1000;
        match self.window {
            Window::Fixed => Period::Fixed(width),
            Window::Sliding => Period::Sliding(width),
        }
    }
}

/// One window a request counts in: what it counts, and its limit's window.
struct Counting {
    what: &'static str,
    window_s: u32,
    window: kv::Window,
}

impl RateLimit {
    /// Whether any window counts tokens.
    fn counts_tokens(&self) -> bool {
        self.spans.iter().any(|(limit, _)| limit.tokens.is_some())
    }

    /// The windows counting `what` for this request's bucket (the `by`
    /// key's value), each adding `amount`; `refusing`: each refuses at
    /// its limit, else at none.
    fn counting(&self, what: &'static str, amount: u64, refusing: bool) -> Vec<Counting> {
        let bucket = context::get_text(&self.by).unwrap_or_default();
        let spans = self.spans.iter().filter_map(|(limit, suffix)| {
            let most = match what {
                "requests" => limit.requests.map(u64::from),
                _ => limit.tokens,
            }?;
            Some(Counting {
                what,
                window_s: limit.window_s,
                window: kv::Window {
                    key: format!("{what}:{}:{bucket}{suffix}", self.by),
                    period: limit.period(),
                    limit: if refusing { most } else { u64::MAX },
                    amount,
                },
            })
        });
        spans.collect()
    }

    /// Counts the request and holds `reserve` tokens for it (what its
    /// model call may use) in every window, all or nothing: refused past
    /// a limit. What it saw goes to the shared context either way.
    fn admit(&self, reserve: u64) -> Result<Taken, FilterError> {
        let mut counting = self.counting("requests", 1, true);
        counting.extend(self.counting("tokens", reserve, true));
        let windows: Vec<kv::Window> = counting.iter().map(|c| c.window.clone()).collect();
        let taken = kv::take(&windows)?;
        let mut held = Taken::default();
        let mut refused = None;
        let mut tightest: Vec<(&str, u64, u64, u64)> = Vec::new();
        for (counted, seen) in counting.iter().zip(&taken.windows) {
            let (what, limit) = (counted.what, counted.window.limit);
            // A request's own count is in what its window has left.
            let own = u64::from(what == "requests" && taken.admitted);
            let remaining = limit.saturating_sub(seen.used + own);
            match tightest.iter_mut().find(|(w, ..)| *w == what) {
                Some(shown)
                    if (remaining, u64::MAX - seen.reset_ms) < (shown.2, u64::MAX - shown.3) =>
                {
                    *shown = (what, limit, remaining, seen.reset_ms);
                }
                Some(_) => {}
                None => tightest.push((what, limit, remaining, seen.reset_ms)),
            }
            if seen.used >= limit && refused.is_none() {
                refused = Some((what, limit, counted.window_s, seen.reset_ms));
            }
            if taken.admitted {
                let hold = Hold::of(&counted.window, seen);
                match what {
                    "requests" => held.requests.push(hold),
                    _ => held.tokens.push(hold),
                }
            }
        }
        for (what, limit, remaining, reset_ms) in tightest {
            context::report_limit(what, limit, remaining, reset_ms);
        }
        let Some((what, limit, window_s, reset_ms)) = refused else {
            return Ok(held);
        };
        Err(FilterError::new(
            ErrorKind::LimitExceeded,
            format!(
                "rate limit of {limit} {what} per {window_s} s reached; retry in {} s",
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

    /// Adds `amount` tokens to every window without refusing (a model
    /// call of a turn already admitted, an answer's usage nothing was
    /// held for).
    fn count(&self, amount: u64) -> Result<Vec<Hold>, FilterError> {
        let windows: Vec<kv::Window> = (self.counting("tokens", amount, false).into_iter())
            .map(|c| c.window)
            .collect();
        let taken = kv::take(&windows)?;
        Ok(windows
            .iter()
            .zip(&taken.windows)
            .map(|(w, seen)| Hold::of(w, seen))
            .collect())
    }

    /// Holds `reserve` tokens for a model call of a turn already admitted.
    fn hold(&self, reserve: u64) -> Taken {
        if !self.counts_tokens() {
            return Taken::default();
        }
        match self.count(reserve) {
            Ok(tokens) => Taken {
                requests: Vec::new(),
                tokens,
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
        let used = u64::from(response.usage().total_tokens);
        if !taken.tokens.is_empty() {
            for held in &taken.tokens {
                held.settle(used, "rate-limit");
            }
            return;
        }
        if used == 0 || !self.counts_tokens() {
            return;
        }
        if let Err(e) = self.count(used) {
            shallot_guest::log::warn(&format!(
                "rate-limit: owed: {used} tokens not counted, the answer delivered: {}",
                e.message
            ));
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
    requests: Vec<Hold>,
    tokens: Vec<Hold>,
}

impl Taken {
    /// What the request's failure with `error` gives back: the tokens held
    /// for an answer that never came, and the request's place if
    /// [`refunded`].
    fn failed(&self, error: &FilterError) {
        let places = self.requests.iter().filter(|_| refunded(error));
        for held in self.tokens.iter().chain(places) {
            held.settle(0, "rate-limit");
        }
    }
}

#[shallot_guest::filter(name = "rate-limit")]
impl Filter for RateLimit {
    type State = Turned;

    fn configure(&mut self) -> Result<(), String> {
        let spans: Vec<(Limit, String)> = if self.limits.is_empty() {
            let one = Limit {
                requests: self.requests,
                tokens: self.tokens,
                window_s: self.window_s,
                window: self.window,
            };
            vec![(one, String::new())]
        } else if self.requests.is_some() || self.tokens.is_some() {
            return Err("rate-limit: give `limits` or `requests` and `tokens`, not both".into());
        } else if self.limits.len() > LIMITS_CAP {
            return Err(format!("rate-limit: at most {LIMITS_CAP} `limits`"));
        } else {
            // Each window's counters are its own.
            (self.limits.iter())
                .map(|limit| (limit.clone(), format!(":per-{}s", limit.window_s)))
                .collect()
        };
        for (n, (limit, suffix)) in spans.iter().enumerate() {
            let same = |(other, theirs): &(Limit, String)| {
                theirs == suffix && other.window == limit.window
            };
            if spans[..n].iter().any(same) {
                return Err(format!(
                    "rate-limit: two `limits` of one {} s window: give it both `requests` and `tokens`",
                    limit.window_s
                ));
            }
            if limit.requests.is_none() && limit.tokens.is_none() {
                return Err("rate-limit: give `requests`, `tokens` or both".into());
            }
            if limit.window_s == 0 {
                return Err("rate-limit: `window_s` must be at least 1".into());
            }
        }
        self.spans = spans;
        Ok(())
    }

    fn around_turn(&self, request: &TurnRequest, next: Next<Turned>) -> TurnResult {
        let taken = match self.admitted(0) {
            Ok(taken) => taken,
            Err(refused) => return TurnResult::Error(refused),
        };
        next.fctx().set(&Turned { counted: true });
        let result = next.turn(request);
        if let TurnResult::Error(e) = &result {
            taken.failed(e);
        }
        result
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Turned>,
    ) -> Result<ChatResponse, FilterError> {
        let reserve = match self.counts_tokens() {
            true => u64::from(request.estimated_usage(0).total_tokens),
            false => 0,
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
