//! Turn validation with re-entry: run the turn, check its final answer,
//! and when it fails, run it again with the reason as feedback.
//!
//! The built-in `validation` and `schema-validation` filters are this
//! function with their own checks; a custom validator is a plugin of a
//! few lines:
//!
//! ```no_run
//! use serde::Deserialize;
//! use shallot_guest::{Filter, Next, TurnRequest, TurnResult, validate};
//!
//! /// `{"max_retries": 2}`: answers must end with a full stop.
//! #[derive(Deserialize)]
//! struct FullStop {
//!     max_retries: u32,
//! }
//!
//! #[shallot_guest::filter(name = "full-stop")]
//! impl Filter for FullStop {
//!     fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
//!         validate::reenter(next, request, self.max_retries, validate::feedback, |done| {
//!             let text = done.response().text();
//!             if text.trim_end().ends_with('.') {
//!                 Ok(())
//!             } else {
//!                 Err("the answer must end with a full stop".to_owned())
//!             }
//!         })
//!     }
//! }
//! ```

use serde::Deserialize;

use crate::{Message, Next, TurnDone, TurnRequest, TurnResult};

/// The default feedback: what the model is told when its answer failed a
/// check for `reason`.
pub fn feedback(reason: &str) -> String {
    format!(
        "Your previous answer did not pass validation: {reason}. Please correct it and answer again."
    )
}

/// An operator's feedback option: a template in which `{reason}` is
/// replaced by what failed (refused when it has no `{reason}`), or, when
/// not given, the default [`feedback`]. Use it as a config field with
/// `#[serde(default)]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(try_from = "String")]
pub struct Feedback(Option<String>);

impl TryFrom<String> for Feedback {
    type Error = String;

    fn try_from(template: String) -> Result<Self, String> {
        if template.contains("{reason}") {
            Ok(Feedback(Some(template)))
        } else {
            Err("feedback must contain {reason}".to_owned())
        }
    }
}

impl Feedback {
    /// The message for `reason`.
    pub fn message(&self, reason: &str) -> String {
        match &self.0 {
            Some(template) => template.replace("{reason}", reason),
            None => feedback(reason),
        }
    }
}

/// Runs the turn through `next` and checks a finished one with `check`.
/// While it fails and retries are left, re-enters with the run's whole
/// messages plus a user message with `feedback(reason)`, without loading
/// the stored history again and as a fresh run (not a resume). After
/// `max_retries` re-entries the last result is returned unchanged. An
/// interrupted or failed turn is returned as it is, never re-entered.
pub fn reenter<S>(
    next: Next<S>,
    request: &TurnRequest,
    max_retries: u32,
    feedback: impl Fn(&str) -> String,
    check: impl Fn(&TurnDone) -> Result<(), String>,
) -> TurnResult {
    let mut result = next.turn(request);
    for _ in 0..max_retries {
        let TurnResult::Done(done) = &result else {
            break;
        };
        let Err(reason) = check(done) else {
            break;
        };
        let mut messages = done.messages();
        messages.push(Message::user(feedback(&reason)));
        let again = TurnRequest::new(&messages);
        again.set_load_history(false);
        again.set_resume(false);
        result = next.turn(&again);
    }
    result
}
