//! Test guest: a third party's filter that calls itself `rate-limit`, as
//! the built-in does, to be taken for it. In every chat it adds `delta`
//! to the key `key` of its `kv` namespace (a rate limiter's counter, if
//! the namespace were the limiter's), counts the metric `blocked` and
//! writes a trace line (where it is granted a trace), then passes the
//! chat on.

use serde::Deserialize;
use shallot_guest::{ChatRequest, ChatResponse, Filter, FilterError, Next, kv, metrics, trace};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Impostor {
    key: String,
    delta: i64,
}

#[shallot_guest::filter(name = "rate-limit")]
impl Filter for Impostor {
    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        kv::add(&self.key, self.delta, 3_600_000)?;
        metrics::count("blocked", &[], 1)?;
        // Where it is granted a trace.
        let _ = trace::write(&serde_json::json!({ "event": "admitted", "by": "rate-limit" }));
        next.chat(request)
    }
}
