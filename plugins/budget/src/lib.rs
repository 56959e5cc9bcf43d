//! `budget` (chat): spend per client key, tenant, user or any context
//! key, per hour, day or month (UTC), from the usage each model call
//! reports times a price table, counted in the `kv` grant's store, so that
//! gateways sharing one Redis share one budget. Streamed answers are
//! counted too (their usage, once the stream ends).
//!
//! Before a model call is forwarded, the most it may cost is held: its
//! messages' text at four bytes a token in, its `max_tokens` (or
//! `reserve_output_tokens`, 4096) out, at the price of the model it asks
//! for (the table's highest where it does not price that one). It is
//! refused, `limit-exceeded` saying when the period ends, once
//! what the bucket spent this period and what calls in flight hold reach
//! the limit; so ten calls at once against a budget for seven serve seven.
//! When the answer comes, its cost replaces what was held (a call that
//! fails costs nothing); the call that crosses the limit is served. What
//! it saw goes to the shared
//! context's `rate_limit` key as `budget` (micro-dollars), so a refusal is
//! answered with `Retry-After` by `shallot serve`.
//!
//! Config: `{"limit_usd": 10, "period": "day", "by": "key", "prices":
//! {"gpt-4o": {"input": 2.5, "output": 10}, "*": {"input": 1, "output":
//! 1}}, "reserve_output_tokens": 4096}`: prices in dollars per million
//! tokens, by the model that answered (`*` for any other; a model with no
//! price and no `*` costs nothing and is logged). Needs `grants.clock` (the period is the calendar's):
//! without it every call is refused with an `auth` error saying so.
//! `on_store_error` (`closed`, or `open`) says what a call gets while the
//! store fails: refused, or let through unchecked; an answer already made
//! is delivered and its price charged after it (or logged as owed).

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use shallot_guest::kv::OnStoreError;
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Next, Usage, context, kv, log,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Budget {
    limit_usd: f64,
    #[serde(default)]
    period: Period,
    #[serde(default = "default_by")]
    by: String,
    prices: HashMap<String, Price>,
    /// What a request gets while the store fails: refused (`closed`), or
    /// let through unchecked (`open`).
    #[serde(default = "closed")]
    on_store_error: OnStoreError,
    /// The output tokens held for a call that sets no `max_tokens`.
    #[serde(default = "default_reserve")]
    reserve_output_tokens: u32,
}

fn default_reserve() -> u32 {
    4096
}

fn closed() -> OnStoreError {
    OnStoreError::Closed
}

/// Dollars per million tokens.
#[derive(Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct Price {
    input: f64,
    output: f64,
}

impl Price {
    /// What `usage` costs, in micro-dollars, rounded up.
    fn of(&self, usage: &Usage) -> u64 {
        let cost = f64::from(usage.input_tokens) * self.input
            + f64::from(usage.output_tokens) * self.output;
        cost.ceil() as u64
    }
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Period {
    Hour,
    #[default]
    Day,
    Month,
}

fn default_by() -> String {
    "key".to_owned()
}

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The first day (days since the epoch) of the month after the one `day`
/// is in, and that month's number (months since 1970-01).
fn next_month(day: u64) -> (u64, u64) {
    // Howard Hinnant's civil-from-days, then days-from-civil.
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (year, month) = if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    };
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let first = era * 146_097 + doe - 719_468;
    (first as u64, ((year - 1970) * 12 + month - 2) as u64)
}

impl Budget {
    fn limit_micro(&self) -> u64 {
        (self.limit_usd * 1e6).round() as u64
    }

    /// The counter of this period for the request's bucket, and the
    /// milliseconds until the period ends.
    fn period(&self) -> (String, u64) {
        let now = now_ms();
        let (index, end) = match self.period {
            Period::Hour => (now / HOUR_MS, (now / HOUR_MS + 1) * HOUR_MS),
            Period::Day => (now / DAY_MS, (now / DAY_MS + 1) * DAY_MS),
            Period::Month => {
                let (first, month) = next_month(now / DAY_MS);
                (month, first * DAY_MS)
            }
        };
        let bucket = context::get_text(&self.by).unwrap_or_default();
        (format!("spent:{}:{bucket}:{index}", self.by), end - now)
    }

    /// The price of `model`, or of any other (`*`).
    fn price(&self, model: &str) -> Option<&Price> {
        self.prices.get(model).or_else(|| self.prices.get("*"))
    }

    /// What `response` cost, in micro-dollars, rounded up.
    fn cost(&self, response: &ChatResponse) -> u64 {
        let model = response.model();
        let Some(price) = self.price(&model) else {
            log::warn(&format!(
                "budget: no price for the model '{model}'; its call costs nothing"
            ));
            return 0;
        };
        price.of(&response.usage())
    }

    /// The most `request` may cost, in micro-dollars: its estimated input
    /// and its `max_tokens` (or `reserve_output_tokens`) at the price of
    /// the model it asks for (its `model` option, else the one the client
    /// named, the context's `model`), or where the table prices neither,
    /// at the table's highest prices.
    fn worst_case(&self, request: &ChatRequest) -> u64 {
        let named = [
            request.model(),
            context::get_text("model").unwrap_or_default(),
        ];
        let highest = || Price {
            input: self.prices.values().map(|p| p.input).fold(0.0, f64::max),
            output: self.prices.values().map(|p| p.output).fold(0.0, f64::max),
        };
        let price = named
            .iter()
            .find_map(|model| self.prices.get(model.as_str()))
            .map_or_else(highest, |price| *price);
        price.of(&request.estimated_usage(self.reserve_output_tokens))
    }
}

#[shallot_guest::filter(name = "budget")]
impl Filter for Budget {
    fn configure(&mut self) -> Result<(), String> {
        if !(self.limit_usd > 0.0 && self.limit_usd.is_finite()) {
            return Err("budget: `limit_usd` must be a positive amount".into());
        }
        let negative = self
            .prices
            .values()
            .any(|p| !(p.input >= 0.0 && p.output >= 0.0));
        if negative {
            return Err("budget: prices must be amounts of 0 or more".into());
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        if now_ms() == 0 {
            return Err(FilterError::new(
                ErrorKind::Auth,
                "budget: its periods are the calendar's: the operator grants the clock with `grants = { clock = true, kv = ... }`",
            ));
        }
        let (key, reset_ms) = self.period();
        let limit = self.limit_micro();
        // Kept a day past its period, so a clock a little behind another
        // host's still finds it.
        let keep = reset_ms + DAY_MS;
        // The worst this call may cost is held before it is forwarded, so
        // that calls in flight count against the budget: a call is refused
        // once what was spent and what others hold reach the limit.
        let worst = self.worst_case(request);
        let read = kv::add(&key, worst as i64, keep);
        let (spent, held) = match self.on_store_error.tolerate(read, "budget")? {
            Some(count) => ((count.value.max(0) as u64).saturating_sub(worst), worst),
            None => (0, 0),
        };
        context::report_limit("budget", limit, limit.saturating_sub(spent), reset_ms);
        let settle = |cost: u64| {
            let delta = cost as i64 - held as i64;
            if delta == 0 {
                return;
            }
            if let Some(count) = kv::charge(&key, delta, keep, "budget") {
                let spent = count.value.max(0) as u64;
                context::report_limit("budget", limit, limit.saturating_sub(spent), reset_ms);
            }
        };
        if spent >= limit {
            settle(0);
            return Err(FilterError::new(
                ErrorKind::LimitExceeded,
                format!(
                    "the budget of ${:.2} a {} is spent; it renews in {} s",
                    self.limit_usd,
                    match self.period {
                        Period::Hour => "hour",
                        Period::Day => "day",
                        Period::Month => "month",
                    },
                    reset_ms.div_ceil(1000)
                ),
            ));
        }
        // What the answer cost replaces what was held (nothing, when it
        // failed); the answer is delivered whatever the store does (a charge
        // it cannot take is logged as owed).
        let response = next.chat(request).inspect_err(|_| settle(0))?;
        settle(self.cost(&response));
        Ok(response)
    }
}
