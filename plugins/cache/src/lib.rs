//! `cache` (chat): an exact-match response cache over the `kv` grant. A
//! model call whose model, messages, tools and options are the same as
//! one answered within `ttl_s` (in the same `by` scope: the tenant, by
//! default) is answered from the cache without calling the model; a
//! client that streams gets the cached answer as a stream, as any answer
//! a filter gives. Only whole text answers are kept (finished complete,
//! at the length limit or a stop sequence; no tool calls; at most
//! `max_bytes`).
//!
//! A request opts out with the option `"cache": false` (with OpenAI's
//! SDKs, `extra_body={"cache": false}`): it is neither answered from nor
//! written to the cache. The option is the filter's own and is taken off
//! before the request goes on. The answer says what happened in its
//! metadata (`{"cache": "hit"}`, `"miss"` or `"skip"`), and in the shared
//! context's `cache` key, which `shallot serve` answers as the
//! `x-shallot-cache` header.
//!
//! Identical misses make one model call: the first holds a lease (for at
//! most `coalesce_s`) while it asks the model, and the others, on any
//! gateway sharing the store, wait for its answer while the filter may
//! sleep (`grants.sleep_ms`), answered as hits once it is kept.
//!
//! Config: `{"ttl_s": 3600, "max_bytes": 262144, "by": "tenant",
//! "coalesce_s": 60, "on_store_error": "open"}`: while the store fails,
//! `open` answers as on
//! a miss, `closed` fails the request; an answer made is delivered whether
//! or not it can be kept. The key
//! is a SHA-256 of the request as the filter sees it (its `user` option
//! aside), so a new version of the plugin may miss what an older one
//! cached; nothing else is lost.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use shallot_guest::kv::OnStoreError;
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, FinishReason, Next, Usage, context,
    kv, log, timer,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cache {
    #[serde(default = "default_ttl")]
    ttl_s: u32,
    #[serde(default = "default_max_bytes")]
    max_bytes: usize,
    #[serde(default = "default_by")]
    by: String,
    /// What a request gets while the store fails: the model's answer, as
    /// on a miss (`open`), or an error (`closed`).
    #[serde(default = "open")]
    on_store_error: OnStoreError,
    /// How long the first of identical misses holds the others waiting
    /// for its answer at most, in seconds; 0 asks the model for each.
    #[serde(default = "default_coalesce")]
    coalesce_s: u32,
}

fn default_coalesce() -> u32 {
    60
}

fn open() -> OnStoreError {
    OnStoreError::Open
}

fn default_ttl() -> u32 {
    3600
}

fn default_max_bytes() -> usize {
    256 << 10
}

fn default_by() -> String {
    "tenant".to_owned()
}

/// What the cache keeps of an answer.
#[derive(Serialize, Deserialize)]
struct Kept {
    text: String,
    /// How it finished: `complete`, `length-limit` or `stop-sequence`.
    finish: String,
    input_tokens: u32,
    output_tokens: u32,
}

/// The options a request's answer does not depend on, or that are ours.
const NOT_KEYED: [&str; 2] = ["cache", "user"];

impl Cache {
    /// The request's cache key, and whether it opted out; its `cache`
    /// option is taken off.
    fn key(&self, request: &ChatRequest) -> Result<(String, bool), FilterError> {
        let mut options: Map<String, Value> =
            serde_json::from_str(&request.options()).unwrap_or_default();
        let skip = options.get("cache") == Some(&Value::Bool(false));
        if options.contains_key("cache") {
            let mut passed = options.clone();
            passed.remove("cache");
            let passed = Value::Object(passed).to_string();
            request
                .set_options(&passed)
                .map_err(|e| FilterError::new(ErrorKind::Internal, e))?;
        }
        for key in NOT_KEYED {
            options.remove(key);
        }
        let scope = context::get_text(&self.by).unwrap_or_default();
        let mut hash = Sha256::new();
        for part in [
            scope,
            context::get_text("model").unwrap_or_default(),
            format!("{:?}", request.messages()),
            format!("{:?}", request.tools()),
            Value::Object(options).to_string(),
        ] {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part.as_bytes());
        }
        let digest: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok((format!("response:{digest}"), skip))
    }

    /// What to keep of `response`, if it is a whole text answer that fits.
    fn keepable(&self, response: &ChatResponse) -> Option<String> {
        let finish = match response.finish_reason() {
            FinishReason::Complete => "complete",
            FinishReason::LengthLimit => "length-limit",
            FinishReason::StopSequence => "stop-sequence",
            _ => return None,
        };
        if !response.message().tool_calls.is_empty() {
            return None;
        }
        let usage = response.usage();
        let kept = Kept {
            text: response.text(),
            finish: finish.to_owned(),
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
        };
        let value = serde_json::to_string(&kept).ok()?;
        (value.len() <= self.max_bytes).then_some(value)
    }
}

/// Marks `response` (and the invoke) with what the cache did.
fn said(response: &ChatResponse, what: &str) -> Result<(), FilterError> {
    let mut metadata: Map<String, Value> =
        serde_json::from_str(&response.metadata()).unwrap_or_default();
    metadata.insert("cache".into(), what.into());
    response
        .set_metadata(&Value::Object(metadata).to_string())
        .map_err(|e| FilterError::new(ErrorKind::Internal, e))?;
    context::set("cache", what);
    Ok(())
}

/// What a miss does about identical misses at once.
enum Miss {
    /// Asks the model (single flight is off).
    Alone,
    /// Asks the model, holding the lease (its key) the others wait on.
    Leads(String),
    /// Waits for the answer the lease's holder is making.
    Follows(String),
}

impl Miss {
    /// Ends a lead: those waiting go on, to the answer kept or to the
    /// model.
    fn done(&self) {
        if let Miss::Leads(lease) = self {
            let _ = kv::delete(lease);
        }
    }
}

impl Cache {
    /// Takes the lease of `key`'s answer, or finds it taken. A store that
    /// fails leaves the miss to lead.
    fn miss(&self, key: &str) -> Miss {
        if self.coalesce_s == 0 {
            return Miss::Alone;
        }
        let lease = format!("making:{key}");
        match kv::add(&lease, 1, u64::from(self.coalesce_s) * 1000) {
            Ok(count) if count.value > 1 => Miss::Follows(lease),
            _ => Miss::Leads(lease),
        }
    }
}

/// The answer kept at `key`, if the store has one and can say.
fn kept(key: &str) -> Option<Kept> {
    let entry = kv::get(key).ok()??;
    serde_json::from_str(&entry.value).ok()
}

/// The first pause between looks at an answer being made, in ms; each is
/// twice the one before, up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: u32 = 10;
const LONGEST_PAUSE: u32 = 500;

/// Waits for the answer an identical request is making (while it holds
/// `lease`) to be kept at `key`, looking again after longer and longer
/// pauses. `None`, for the caller to ask the model itself, once the
/// lease is gone with nothing kept (the answer failed or was not one to
/// keep), once the filter may sleep no longer (its `sleep_ms` grant), or
/// when the store fails.
fn waited(key: &str, lease: &str) -> Option<Kept> {
    let mut pause = FIRST_PAUSE;
    loop {
        timer::sleep(pause).ok()?;
        // The lease is read first: an answer is kept before it goes.
        let making = kv::get(lease).ok()?.is_some();
        if let Some(kept) = kept(key) {
            return Some(kept);
        }
        if !making {
            return None;
        }
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

fn answer(kept: Kept) -> ChatResponse {
    let reason = match kept.finish.as_str() {
        "length-limit" => FinishReason::LengthLimit,
        "stop-sequence" => FinishReason::StopSequence,
        _ => FinishReason::Complete,
    };
    let response = ChatResponse::from_text(kept.text, reason);
    response.set_usage(Usage {
        input_tokens: kept.input_tokens,
        output_tokens: kept.output_tokens,
        total_tokens: kept.input_tokens.saturating_add(kept.output_tokens),
    });
    response
}

#[shallot_guest::filter(name = "cache")]
impl Filter for Cache {
    fn configure(&mut self) -> Result<(), String> {
        if self.ttl_s == 0 {
            return Err("cache: `ttl_s` must be at least 1".into());
        }
        if self.max_bytes > 1 << 20 {
            return Err("cache: `max_bytes` is at most 1 MiB (1048576), a kv value's most".into());
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        let (key, skip) = self.key(request)?;
        if skip {
            let response = next.chat(request)?;
            said(&response, "skip")?;
            return Ok(response);
        }
        let found = self.on_store_error.tolerate(kv::get(&key), "cache")?;
        if let Some(entry) = found.flatten()
            && let Ok(kept) = serde_json::from_str::<Kept>(&entry.value)
        {
            let response = answer(kept);
            said(&response, "hit")?;
            return Ok(response);
        }
        // One of identical misses asks the model; the others wait for its
        // answer (here or on another replica sharing the store).
        let miss = self.miss(&key);
        let ready = match &miss {
            Miss::Alone => None,
            // The lease may be new because the one before it just went, its
            // answer kept: looked for once more.
            Miss::Leads(_) => kept(&key),
            Miss::Follows(lease) => waited(&key, lease),
        };
        if let Some(kept) = ready {
            miss.done();
            let response = answer(kept);
            said(&response, "hit")?;
            return Ok(response);
        }
        let made = next.chat(request);
        // The answer the model made is delivered whether or not it is kept
        // (a full namespace keeps no more until some expire; a failing
        // store keeps none).
        if let Ok(response) = &made
            && let Some(value) = self.keepable(response)
            && let Err(e) = kv::set(&key, &value, u64::from(self.ttl_s) * 1000)
        {
            log::warn(&format!("cache: not kept: {}", e.message));
        }
        miss.done();
        let response = made?;
        said(&response, "miss")?;
        Ok(response)
    }
}
