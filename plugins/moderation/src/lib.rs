//! `moderation`: asks a moderation service about what goes to the model,
//! what comes back, or both, over the `http` grant.
//!
//! Two wires: OpenAI's `/v1/moderations` (`{"model", "input"}` ->
//! `{"results": [{"flagged", "categories"}]}`), or a plain JSON webhook
//! (`{"text", "role", "context"}` -> `{"flagged", "reason"}`).
//!
//! The input is checked in `around-chat`, before the model is called: a
//! flagged one is answered by the filter itself with `failure_response`
//! (finish reason `content-filtered`), the model never called. The output
//! is checked in the token transform, which every answer goes through,
//! streamed or not: it holds back `window` characters, asks about them
//! (with the last 64 characters released before, so a phrase split across
//! two windows is seen whole once), and releases them only once they
//! passed; a flagged window, and everything after it, is replaced by
//! `withheld`. Nothing unchecked reaches the client, in a stream as in
//! JSON. The history keeps what the model said.
//!
//! `action = "flag"` lets everything through and logs what was flagged
//! (an input's answer also carries `{"moderation": {"flagged": ...}}` in
//! its metadata). A service that fails (unreachable, an error status, an
//! answer that is not its wire) counts as flagged with `fail = "closed"`
//! (the default) and as passed with `fail = "open"`.
//!
//! Each check is counted in the filter's `checks` metric, by `role`
//! (`user`, `assistant`) and `outcome` (`passed`, `flagged`, `failed`).
//!
//! Each window is one request; a token transform's requests count per
//! stream, so grant `requests` of at least the longest answer over
//! `window`, plus one.

use serde::Deserialize;
use serde_json::{Value, json};
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, FinishReason, HeldTokens, Next, Role, TokenOut,
    TokenTransform, Tokens, context, log, metrics,
};
use wstd::http::{Body, Client, Request};

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Wire {
    Openai,
    Webhook,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Check {
    Input,
    Output,
    Both,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Action {
    Block,
    Flag,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Fail {
    Closed,
    Open,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Moderation {
    /// The service: OpenAI's `.../v1/moderations`, or the webhook.
    url: String,
    #[serde(default = "openai")]
    wire: Wire,
    /// The moderation model (OpenAI's wire); the service's default if none.
    model: Option<String>,
    /// Sent as `Authorization: Bearer <api_key>` when set.
    api_key: Option<String>,
    #[serde(default = "both")]
    check: Check,
    #[serde(default = "block")]
    action: Action,
    #[serde(default = "closed")]
    fail: Fail,
    /// Characters of output held back and checked at once.
    #[serde(default = "window")]
    window: usize,
    #[serde(default = "failure_response")]
    failure_response: String,
    #[serde(default = "withheld")]
    withheld: String,
}

fn openai() -> Wire {
    Wire::Openai
}
fn both() -> Check {
    Check::Both
}
fn block() -> Action {
    Action::Block
}
fn closed() -> Fail {
    Fail::Closed
}
fn window() -> usize {
    256
}
fn failure_response() -> String {
    "Sorry, I can't help with that request.".into()
}
fn withheld() -> String {
    "[withheld by moderation]".into()
}

/// Characters of released output sent again with the next window.
const OVERLAP: usize = 64;

/// What the service said of a text.
enum Verdict {
    Passed,
    Flagged(String),
}

impl Moderation {
    /// Asks the service about `text` (from `role`); a failure is judged
    /// by `fail`. Each check is counted in the `checks` metric, by role
    /// and outcome.
    fn verdict(&self, text: &str, role: &str, context: Value) -> Verdict {
        let asked = wstd::runtime::block_on(self.ask(text, role, context));
        let outcome = match &asked {
            Ok(Some(_)) => "flagged",
            Ok(None) => "passed",
            Err(_) => "failed",
        };
        if let Err(e) = metrics::count("checks", &[("role", role), ("outcome", outcome)], 1) {
            log::warn(&format!("could not count the check: {}", e.message));
        }
        match asked {
            Ok(Some(reason)) => Verdict::Flagged(reason),
            Ok(None) => Verdict::Passed,
            Err(why) => {
                log::warn(&format!("the moderation service failed: {why}"));
                match self.fail {
                    Fail::Closed => {
                        Verdict::Flagged(format!("the moderation service failed: {why}"))
                    }
                    Fail::Open => Verdict::Passed,
                }
            }
        }
    }

    /// The reason the service flagged `text`, or none.
    async fn ask(&self, text: &str, role: &str, context: Value) -> Result<Option<String>, String> {
        let body = match self.wire {
            Wire::Openai => {
                let mut body = json!({ "input": text });
                if let Some(model) = &self.model {
                    body["model"] = json!(model);
                }
                body
            }
            Wire::Webhook => json!({ "text": text, "role": role, "context": context }),
        };
        let body = body.to_string();
        let mut request = Request::post(&self.url)
            .header("content-type", "application/json")
            .header("content-length", body.len());
        if let Some(key) = &self.api_key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = request.body(Body::from(body)).map_err(|e| e.to_string())?;
        let mut response = Client::new()
            .send(request)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let status = response.status();
        let answer = response
            .body_mut()
            .contents()
            .await
            .map_err(|e| format!("{e:#}"))?;
        if !status.is_success() {
            return Err(format!("it answered {status}"));
        }
        let answer: Value =
            serde_json::from_slice(answer).map_err(|e| format!("its answer is not JSON: {e}"))?;
        match self.wire {
            Wire::Openai => openai_verdict(&answer),
            Wire::Webhook => match answer["flagged"].as_bool() {
                Some(true) => Ok(Some(
                    answer["reason"].as_str().unwrap_or("flagged").to_owned(),
                )),
                Some(false) => Ok(None),
                None => Err("its answer has no `flagged`".into()),
            },
        }
    }
}

/// The flagged categories of OpenAI's answer, or none.
fn openai_verdict(answer: &Value) -> Result<Option<String>, String> {
    let results = answer["results"]
        .as_array()
        .filter(|r| !r.is_empty())
        .ok_or("its answer has no `results`")?;
    let mut categories = Vec::new();
    let mut flagged = false;
    for result in results {
        flagged |= result["flagged"]
            .as_bool()
            .ok_or("a result has no `flagged`")?;
        if let Some(map) = result["categories"].as_object() {
            categories.extend(
                map.iter()
                    .filter(|(_, v)| v.as_bool() == Some(true))
                    .map(|(k, _)| k.clone()),
            );
        }
    }
    Ok(flagged.then(|| {
        if categories.is_empty() {
            "flagged".to_owned()
        } else {
            categories.join(", ")
        }
    }))
}

/// The identity the gateway or the embedder set, for the webhook.
fn who() -> Value {
    let mut who = serde_json::Map::new();
    for key in ["tenant", "user"] {
        if let Some(value) = context::get_text(key) {
            who.insert(key.into(), json!(value));
        }
    }
    Value::Object(who)
}

#[shallot_guest::filter(name = "moderation")]
impl Filter for Moderation {
    fn configure(&mut self) -> Result<(), String> {
        if !self.url.starts_with("http://") && !self.url.starts_with("https://") {
            return Err(format!("url: `{}` is not an http(s) URL", self.url));
        }
        if self.window == 0 {
            return Err("window: must be at least 1 character".into());
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        if self.check == Check::Output {
            return next.chat(request);
        }
        let messages = request.messages();
        let Some(last) = messages.iter().rev().find(|m| m.role == Role::User) else {
            return next.chat(request);
        };
        let Verdict::Flagged(reason) = self.verdict(&last.text(), "user", who()) else {
            return next.chat(request);
        };
        let verdict = json!({ "moderation": { "flagged": "input", "reason": reason } });
        if self.action == Action::Flag {
            log::warn(&format!("flagged the input: {reason}"));
            let response = next.chat(request)?;
            response
                .set_metadata(&verdict.to_string())
                .map_err(FilterError::invalid)?;
            return Ok(response);
        }
        let response = ChatResponse::from_text(
            self.failure_response.as_str(),
            FinishReason::ContentFiltered,
        );
        response
            .set_metadata(&verdict.to_string())
            .map_err(FilterError::invalid)?;
        Ok(response)
    }

    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Window {
            moderation: self.clone(),
            held: HeldTokens::default(),
            released: String::new(),
            withheld: false,
        })
    }
}

/// One answer's moderation: the tokens held back, the tail of what was
/// released, and whether the rest is withheld.
struct Window {
    moderation: Moderation,
    held: HeldTokens,
    released: String,
    withheld: bool,
}

impl Window {
    /// Checks what is held (the last window may be short) and releases it
    /// as it came if it passed.
    fn release(&mut self, out: &mut TokenOut) {
        let held = self.held.text();
        if held.is_empty() || self.withheld {
            return;
        }
        let text = format!("{}{held}", self.released);
        match self.moderation.verdict(&text, "assistant", json!({})) {
            Verdict::Flagged(reason) if self.moderation.action == Action::Block => {
                log::warn(&format!("withheld the output: {reason}"));
                out.push(&self.moderation.withheld, None);
                self.held = HeldTokens::default();
                self.withheld = true;
                return;
            }
            Verdict::Flagged(reason) => log::warn(&format!("flagged the output: {reason}")),
            Verdict::Passed => {}
        }
        self.held.release(out);
        self.released = tail(&text, OVERLAP);
    }
}

/// The last `n` characters of `text`.
fn tail(text: &str, n: usize) -> String {
    let start = text
        .char_indices()
        .rev()
        .nth(n.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    text[start..].to_owned()
}

impl TokenTransform for Window {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        if self.moderation.check == Check::Input || self.withheld {
            if !self.withheld {
                out.push_all(tokens);
            }
            return Ok(());
        }
        self.held.hold(&tokens);
        if self.held.text().chars().count() >= self.moderation.window {
            self.release(out);
        }
        Ok(())
    }

    fn flush(&mut self, _: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        self.release(out);
        Ok(())
    }
}
