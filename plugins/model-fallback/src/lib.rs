//! `model-fallback` (chat): when a model call fails with an error worth
//! another model (by default `transient`, `timeout`, `auth` or
//! `not-found`), calls `next` again with the request's `model` option set
//! to the next model of `models`, in order, until one answers. When every
//! model has failed, the last failure is returned as it was (its origin
//! kept). Any other error (`invalid-request`, `content-filtered`, ...) is
//! returned at once: another model would not help.
//!
//! Config: `{"models": ["backup-1", "backup-2"], "on": ["transient",
//! "timeout", "auth", "not-found"]}` (`on` optional).

use serde::Deserialize;
use serde_json::{Map, Value};
use shallot_guest::{ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Next, log};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFallback {
    models: Vec<String>,
    #[serde(default = "default_triggers")]
    on: Vec<Trigger>,
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
        if let Some(empty) = self.models.iter().position(|m| m.trim().is_empty()) {
            return Err(format!("models[{empty}] is empty"));
        }
        Ok(())
    }

    fn wants(&self, _: shallot_guest::Hook) -> bool {
        !self.models.is_empty()
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        let mut error = match next.chat(request) {
            Ok(response) => return Ok(response),
            Err(error) => error,
        };
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
            log::warn(&format!(
                "{from} failed ({}: {}); falling back to {model}",
                error.kind.as_str(),
                error.message
            ));
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
}
