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
//! price and no `*` costs nothing and is logged). The hold and the
//! refusal are one `kv.take`, atomic on the store's clock (the period is
//! that clock's calendar), and what the answer cost settles the period
//! the hold was taken from, never a later one.
//! `on_store_error` (`closed`, or `open`) says what a call gets while the
//! store fails: refused, or let through unchecked; an answer already made
//! is delivered and its price charged after it (or logged as owed).

use std::collections::HashMap;

use serde::Deserialize;
use shallot_guest::kv::{Hold, OnStoreError};
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

impl Budget {
    fn limit_micro(&self) -> u64 {
        (self.limit_usd * 1e6).round() as u64
    }

    /// The window of this period for the request's bucket, holding
    /// `amount`.
    fn window(&self, amount: u64) -> kv::Window {
        let bucket = context::get_text(&self.by).unwrap_or_default();
        kv::Window {
            key: format!("spent:{}:{bucket}", self.by),
            period: match self.period {
                Period::Hour => kv::Period::Aligned(HOUR_MS),
                Period::Day => kv::Period::Aligned(24 * HOUR_MS),
                Period::Month => kv::Period::Month,
            },
            limit: self.limit_micro(),
            amount,
        }
    }

    /// Adds what an answer nothing was held for cost (the store failed
    /// before it, and the operator let it through): logged as owed if the
    /// store cannot take it.
    fn charge(&self, cost: u64) {
        let window = kv::Window {
            limit: u64::MAX,
            ..self.window(cost)
        };
        if let Err(e) = kv::take(&[window]) {
            log::warn(&format!(
                "budget: owed: {cost} not added, the answer delivered: {}",
                e.message
            ));
        }
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
        let limit = self.limit_micro();
        // The worst this call may cost is held before it is forwarded, so
        // that calls in flight count against the budget: a call is refused
        // once what was spent and what others hold reach the limit.
        let window = self.window(self.worst_case(request));
        let taken = kv::take(std::slice::from_ref(&window));
        let Some(taken) = self.on_store_error.tolerate(taken, "budget")? else {
            let response = next.chat(request)?;
            self.charge(self.cost(&response));
            return Ok(response);
        };
        let seen = &taken.windows[0];
        context::report_limit(
            "budget",
            limit,
            limit.saturating_sub(seen.used),
            seen.reset_ms,
        );
        if !taken.admitted {
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
                    seen.reset_ms.div_ceil(1000)
                ),
            ));
        }
        // What the answer cost replaces what was held (nothing, when it
        // failed); the answer is delivered whatever the store does (a charge
        // it cannot take is logged as owed).
        let held = Hold::of(&window, seen);
        let settle = |cost: u64| {
            if let Some(spent) = held.settle(cost, "budget") {
                context::report_limit("budget", limit, limit.saturating_sub(spent), seen.reset_ms);
            }
        };
        let response = next.chat(request).inspect_err(|_| settle(0))?;
        settle(self.cost(&response));
        Ok(response)
    }
}
