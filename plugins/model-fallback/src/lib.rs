//! `model-fallback` (chat): when a model call fails with an error worth
//! another model (by default `transient`, `timeout`, `auth` or
//! `not-found`), calls `next` again with the request's `model` option set
//! to the next model of `models`, in order, until one answers; or, with
//! `upstreams`, with the shared context's `upstream` key naming the next
//! upstream of the route (the host sends the call there: another provider,
//! another wire), put back as it was afterwards. When every one has
//! failed, the last failure is returned as it was (its origin kept). Any
//! other error (`invalid-request`, `content-filtered`, ...) is returned at
//! once: another model would not help.
//!
//! Config: `{"models": ["backup-1", "backup-2"], "on": ["transient",
//! "timeout", "auth", "not-found"]}` (`on` optional), or `{"upstreams":
//! ["gpu-b", "claude"]}` in place of `models`.

use serde::Deserialize;
use serde_json::{Map, Value};
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Next, context, log,
};

/// The shared-context key naming the upstream a model call goes to.
const UPSTREAM: &str = "upstream";

#[derive(Deserialize)]
#[serde(try_from = "Given")]
struct ModelFallback {
    /// The models to try after the request's own.
    models: Vec<String>,
    /// Or the route's upstreams to try after the one that failed.
    upstreams: Vec<String>,
    /// The error kinds that move on to the next.
    on: Vec<Trigger>,
}

/// The configuration as written: `models` or `upstreams`, exactly one.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Given {
    models: Option<Vec<String>>,
    upstreams: Option<Vec<String>>,
    #[serde(default = "default_triggers")]
    on: Vec<Trigger>,
}

impl TryFrom<Given> for ModelFallback {
    type Error = String;

    fn try_from(given: Given) -> Result<Self, String> {
        let (models, upstreams) = match (given.models, given.upstreams) {
            (Some(models), None) => (models, Vec::new()),
            (None, Some(upstreams)) => (Vec::new(), upstreams),
            (None, None) => return Err("give `models` (or `upstreams`)".to_owned()),
            (Some(_), Some(_)) => return Err("give `models` or `upstreams`, not both".to_owned()),
        };
        Ok(ModelFallback {
            models,
            upstreams,
            on: given.on,
        })
    }
}

/// The error kinds that send a call on to the next model.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Trigger {
    Transient,
    Timeout,
    Auth,
    NotFound,
    LimitExceeded,
    InvalidRequest,
    ContentFiltered,
}

impl Trigger {
    fn matches(self, kind: ErrorKind) -> bool {
        matches!(
            (self, kind),
            (Trigger::Transient, ErrorKind::Transient)
                | (Trigger::Timeout, ErrorKind::Timeout)
                | (Trigger::Auth, ErrorKind::Auth)
                | (Trigger::NotFound, ErrorKind::NotFound)
                | (Trigger::LimitExceeded, ErrorKind::LimitExceeded)
                | (Trigger::InvalidRequest, ErrorKind::InvalidRequest)
                | (Trigger::ContentFiltered, ErrorKind::ContentFiltered)
        )
    }
}

fn default_triggers() -> Vec<Trigger> {
    vec![
        Trigger::Transient,
        Trigger::Timeout,
        Trigger::Auth,
        Trigger::NotFound,
    ]
}

#[shallot_guest::filter(name = "model-fallback")]
impl Filter for ModelFallback {
    fn configure(&mut self) -> Result<(), String> {
        for (what, names) in [("models", &self.models), ("upstreams", &self.upstreams)] {
            if let Some(empty) = names.iter().position(|m| m.trim().is_empty()) {
                return Err(format!("{what}[{empty}] is empty"));
            }
        }
        Ok(())
    }

    fn wants(&self, _: shallot_guest::Hook) -> bool {
        !self.models.is_empty() || !self.upstreams.is_empty()
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        let error = match next.chat(request) {
            Ok(response) => return Ok(response),
            Err(error) => error,
        };
        if self.upstreams.is_empty() {
            self.other_models(request, next, error)
        } else {
            let before = context::get_json(UPSTREAM);
            let answer = self.other_upstreams(request, next, error);
            match before {
                Some(before) => context::set(
                    UPSTREAM,
                    &serde_json::from_str::<Value>(&before).unwrap_or_default(),
                ),
                None => context::remove(UPSTREAM),
            }
            answer
        }
    }
}

impl ModelFallback {
    fn other_models(
        &self,
        request: &ChatRequest,
        next: Next,
        mut error: FilterError,
    ) -> Result<ChatResponse, FilterError> {
        let mut options: Map<String, Value> =
            serde_json::from_str(&request.options()).unwrap_or_default();
        for model in &self.models {
            if !self.on.iter().any(|t| t.matches(error.kind)) {
                break;
            }
            let from = options
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or("the default model");
            falling_back(from, &error, model);
            options.insert("model".to_owned(), Value::String(model.clone()));
            request
                .set_options(&Value::Object(options.clone()).to_string())
                .map_err(FilterError::invalid)?;
            error = match next.chat(request) {
                Ok(response) => return Ok(response),
                Err(error) => error,
            };
        }
        Err(error)
    }

    fn other_upstreams(
        &self,
        request: &ChatRequest,
        next: Next,
        mut error: FilterError,
    ) -> Result<ChatResponse, FilterError> {
        for upstream in &self.upstreams {
            if !self.on.iter().any(|t| t.matches(error.kind)) {
                break;
            }
            let from =
                context::get_text(UPSTREAM).unwrap_or_else(|| "the route's upstream".to_owned());
            falling_back(&from, &error, upstream);
            context::set(UPSTREAM, upstream.as_str());
            error = match next.chat(request) {
                Ok(response) => return Ok(response),
                Err(error) => error,
            };
        }
        Err(error)
    }
}

fn falling_back(from: &str, error: &FilterError, to: &str) {
    log::warn(&format!(
        "{from} failed ({}: {}); falling back to {to}",
        error.kind.as_str(),
        error.message
    ));
}
