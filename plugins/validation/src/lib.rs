//! `validation` (turn): checks the final answer of a turn against the
//! operator's rules; when it fails, re-enters the turn with the run's
//! messages plus a feedback message naming every rule it broke, up to
//! `max_retries` times, then returns the last result unchanged (PEER-CASES
//! H7, H8). Interrupted and failed turns pass through untouched.
//!
//! Config: `{"max_retries": 2, "required": ["Sources:"], "must_match":
//! ["^\\w"], "must_not_match": ["(?i)as an ai"], "max_length": 2000}`.

use regex_lite::Regex;
use serde::Deserialize;
use shallot_guest::{Filter, Next, TurnRequest, TurnResult, validate};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Validation {
    #[serde(default = "default_retries")]
    max_retries: u32,
    /// Substrings the answer must contain.
    #[serde(default)]
    required: Vec<String>,
    /// Patterns the answer must match.
    #[serde(default)]
    must_match: Vec<String>,
    /// Patterns the answer must not match.
    #[serde(default)]
    must_not_match: Vec<String>,
    /// The longest answer, in characters.
    max_length: Option<usize>,
    /// The feedback message; `{reason}` is replaced by what failed.
    #[serde(default)]
    feedback: validate::Feedback,
    #[serde(skip)]
    must: Vec<Regex>,
    #[serde(skip)]
    must_not: Vec<Regex>,
}

fn default_retries() -> u32 {
    2
}

fn compile(patterns: &[String], option: &str) -> Result<Vec<Regex>, String> {
    patterns
        .iter()
        .enumerate()
        .map(|(i, p)| Regex::new(p).map_err(|e| format!("{option}[{i}]: {e}")))
        .collect()
}

impl Validation {
    /// Every rule `text` breaks, joined; `Ok` when it keeps them all.
    fn check(&self, text: &str) -> Result<(), String> {
        let mut broken = Vec::new();
        for needle in &self.required {
            if !text.contains(needle.as_str()) {
                broken.push(format!("it must contain \"{needle}\""));
            }
        }
        for regex in &self.must {
            if !regex.is_match(text) {
                broken.push(format!("it must match /{}/", regex.as_str()));
            }
        }
        for regex in &self.must_not {
            if regex.is_match(text) {
                broken.push(format!("it must not match /{}/", regex.as_str()));
            }
        }
        if let Some(max) = self.max_length {
            let length = text.chars().count();
            if length > max {
                broken.push(format!("it is {length} characters long, more than {max}"));
            }
        }
        if broken.is_empty() {
            Ok(())
        } else {
            Err(broken.join("; "))
        }
    }
}

#[shallot_guest::filter(name = "validation")]
impl Filter for Validation {
    fn configure(&mut self) -> Result<(), String> {
        self.must = compile(&self.must_match, "must_match")?;
        self.must_not = compile(&self.must_not_match, "must_not_match")?;
        Ok(())
    }

    fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
        let feedback = |reason: &str| self.feedback.message(reason);
        validate::reenter(next, request, self.max_retries, feedback, |done| {
            self.check(&done.response().text())
        })
    }
}
