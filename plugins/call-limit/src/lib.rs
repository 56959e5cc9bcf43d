//! `call-limit` (chat): bounds the model calls of one invoke (every round
//! of a turn's tool loop, and every retry a filter inside makes). The
//! count lives in the filter's private context, so it spans the whole
//! invoke. Past `max_model_calls`, `halt` fails the call with a typed
//! `limit-exceeded` error naming the count and the limit, before the model
//! is called; `warn` logs a warning and lets the call through.
//!
//! Config: `{"max_model_calls": 20, "on_limit": "halt"}` (both optional:
//! 20 and `halt`).

use serde::{Deserialize, Serialize};
use shallot_guest::{ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Next, log};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CallLimit {
    #[serde(default = "default_max")]
    max_model_calls: u32,
    #[serde(default)]
    on_limit: OnLimit,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum OnLimit {
    #[default]
    Halt,
    Warn,
}

fn default_max() -> u32 {
    20
}

/// Model calls so far in this invoke.
#[derive(Serialize, Deserialize, Default)]
struct Calls {
    made: u32,
}

#[shallot_guest::filter(name = "call-limit")]
impl Filter for CallLimit {
    type State = Calls;

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Calls>,
    ) -> Result<ChatResponse, FilterError> {
        let fctx = next.fctx();
        let made = fctx.update(|calls| {
            calls.made += 1;
            calls.made
        });
        if made > self.max_model_calls {
            let message = format!(
                "model call {made} of this invoke is over the limit of {}",
                self.max_model_calls
            );
            match self.on_limit {
                OnLimit::Halt => return Err(FilterError::new(ErrorKind::LimitExceeded, message)),
                OnLimit::Warn => log::warn(&message),
            }
        }
        next.chat(request)
    }
}
