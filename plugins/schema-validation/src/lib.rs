//! `schema-validation` (turn): the final answer of a turn must be JSON
//! that a JSON Schema (draft 2020-12, by the `jsonschema` crate) accepts.
//! When it is not, the turn is re-entered with feedback naming each
//! failing path and keyword, up to `max_retries` times, then the last
//! result is returned unchanged (PEER-CASES H9-H14, J).
//!
//! Beyond the standard, `nullable: true` next to a `type` (OpenAPI's
//! spelling) also allows `null`, as the peer did. A ```` ```json ````
//! fence around the answer is stripped first unless `code_fence` is false.
//!
//! Config: `{"schema": {...}, "max_retries": 2, "max_errors": 10,
//! "code_fence": true}`.

use jsonschema::Validator;
use regex_lite::Regex;
use serde::Deserialize;
use serde_json::Value;
use shallot_guest::{Filter, Next, TurnRequest, TurnResult, validate};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SchemaValidation {
    schema: Value,
    #[serde(default = "default_retries")]
    max_retries: u32,
    #[serde(default = "default_max_errors")]
    max_errors: usize,
    #[serde(default = "yes")]
    code_fence: bool,
    /// The feedback message; `{reason}` is replaced by what failed.
    #[serde(default)]
    feedback: validate::Feedback,
    #[serde(skip)]
    compiled: Option<(Validator, Regex)>,
}

fn default_retries() -> u32 {
    2
}
fn default_max_errors() -> usize {
    10
}
fn yes() -> bool {
    true
}

/// Turns OpenAPI's `nullable: true` into a `null` in the `type` beside
/// it, in every subschema.
fn allow_nullable(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            if map.get("nullable") == Some(&Value::Bool(true)) {
                match map.get_mut("type") {
                    Some(Value::String(one)) if one != "null" => {
                        let one = std::mem::take(one);
                        map.insert("type".into(), Value::from(vec![one, "null".to_owned()]));
                    }
                    Some(Value::Array(types)) if !types.iter().any(|t| t == "null") => {
                        types.push("null".into());
                    }
                    _ => {}
                }
            }
            map.values_mut().for_each(allow_nullable);
        }
        Value::Array(items) => items.iter_mut().for_each(allow_nullable),
        _ => {}
    }
}

impl SchemaValidation {
    /// Why `text` is not an acceptable answer, if it is not.
    fn check(&self, text: &str) -> Result<(), String> {
        let (validator, fence) = self.compiled.as_ref().expect("configured");
        if text.trim().is_empty() {
            return Err("the answer has no text to validate as JSON".to_owned());
        }
        let body = match fence.captures(text).and_then(|c| c.get(1)) {
            Some(inside) if self.code_fence => inside.as_str(),
            _ => text,
        };
        let instance: Value = serde_json::from_str(body.trim())
            .map_err(|e| format!("the answer is not valid JSON ({e})"))?;
        let errors: Vec<String> = validator
            .iter_errors(&instance)
            .take(self.max_errors)
            .map(|error| {
                let path = error.instance_path().to_string();
                let path = if path.is_empty() {
                    "#".to_owned()
                } else {
                    path
                };
                format!("{path}: {error} ({})", error.kind().keyword())
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the JSON does not match the schema: {}",
                errors.join("; ")
            ))
        }
    }
}

#[shallot_guest::filter(name = "schema-validation")]
impl Filter for SchemaValidation {
    fn configure(&mut self) -> Result<(), String> {
        if self.max_errors == 0 {
            return Err("max_errors must be at least 1".to_owned());
        }
        let mut schema = self.schema.clone();
        allow_nullable(&mut schema);
        let validator = jsonschema::draft202012::options()
            .build(&schema)
            .map_err(|e| format!("schema: {e} (at {})", e.schema_path()))?;
        let fence = Regex::new(r"(?is)```(?:json)?\s*(.*?)```").expect("a valid pattern");
        self.compiled = Some((validator, fence));
        Ok(())
    }

    fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
        let feedback = |reason: &str| self.feedback.message(reason);
        validate::reenter(next, request, self.max_retries, feedback, |done| {
            self.check(&done.response().text())
        })
    }
}
