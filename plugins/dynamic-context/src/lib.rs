//! `dynamic-context` (system-prompt): puts what changes from one invoke to
//! the next into the system prompt, as AgentScope's `DynamicContext`
//! middleware does: the current date and time (in the operator's UTC
//! offset), and values of the shared context (the gateway's `user`,
//! `tenant`, ...). It runs once per invoke, so every round of a turn sees
//! the same time.
//!
//! The `template` is rendered and added after the prompt it is given (or
//! before it, with `position = "prepend"`), separated by a blank line.
//! Placeholders: `{now}` (RFC 3339, to the second), `{date}`
//! (`2026-12-04`), `{time}` (`09:30`), `{weekday}` (`Friday`), `{offset}`
//! (`+08:00`), and `{context.KEY}` (the shared context's value under KEY:
//! a string as it is, other JSON as JSON, `unknown` when unset).
//!
//! Needs the real clock (`grants = { clock = true }`): without it the
//! clock reads 1970, and the filter refuses to load.
//!
//! Config: `{"template": "Current date and time: {now} ({weekday}).",
//! "utc_offset": "+08:00", "position": "append"}` (all optional).

use std::time::SystemTime;

use serde::Deserialize;
use serde_json::Value;
use shallot_guest::{Filter, FilterError, context};
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, UtcOffset};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DynamicContext {
    #[serde(default = "default_template")]
    template: String,
    #[serde(default = "default_offset")]
    utc_offset: String,
    #[serde(default)]
    position: Position,
    #[serde(skip)]
    offset: Option<UtcOffset>,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Position {
    #[default]
    Append,
    Prepend,
}

fn default_template() -> String {
    "Current date and time: {now} ({weekday}).".to_owned()
}

fn default_offset() -> String {
    "+00:00".to_owned()
}

/// `+HH:MM`, `-HH:MM` or `Z`, as RFC 3339 writes an offset.
fn offset(text: &str) -> Option<UtcOffset> {
    if text == "Z" {
        return Some(UtcOffset::UTC);
    }
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let (hours, minutes) = rest.split_once(':')?;
    if hours.len() != 2 || minutes.len() != 2 {
        return None;
    }
    let (hours, minutes): (i8, i8) = (hours.parse().ok()?, minutes.parse().ok()?);
    // RFC 3339's hours end at 23 (the `time` crate's offsets reach 25).
    if hours > 23 || minutes > 59 {
        return None;
    }
    UtcOffset::from_hms(sign * hours, sign * minutes, 0).ok()
}

impl DynamicContext {
    /// The template with its placeholders filled for `now`.
    fn render(&self, now: OffsetDateTime) -> String {
        let date = format!(
            "{:04}-{:02}-{:02}",
            now.year(),
            u8::from(now.month()),
            now.day()
        );
        let time = format!("{:02}:{:02}", now.hour(), now.minute());
        let (hours, minutes, _) = now.offset().as_hms();
        let sign = if hours < 0 || minutes < 0 { '-' } else { '+' };
        let offset = format!("{sign}{:02}:{:02}", hours.abs(), minutes.abs());
        let mut out = String::with_capacity(self.template.len() + 32);
        let mut rest = self.template.as_str();
        while let Some(at) = rest.find('{') {
            out.push_str(&rest[..at]);
            let Some(end) = rest[at..].find('}') else {
                break;
            };
            let name = &rest[at + 1..at + end];
            match name {
                "now" => out.push_str(&now.format(&Rfc3339).unwrap_or_default()),
                "date" => out.push_str(&date),
                "time" => out.push_str(&time),
                "weekday" => out.push_str(&now.weekday().to_string()),
                "offset" => out.push_str(&offset),
                _ => match name.strip_prefix("context.") {
                    Some(key) => out.push_str(&shown(context::get::<Value>(key))),
                    None => out.push_str(&rest[at..=at + end]),
                },
            }
            rest = &rest[at + end + 1..];
        }
        out.push_str(rest);
        out
    }
}

/// A context value as the prompt says it.
fn shown(value: Option<Value>) -> String {
    match value {
        None | Some(Value::Null) => "unknown".to_owned(),
        Some(Value::String(text)) => text,
        Some(other) => other.to_string(),
    }
}

/// The wall clock, as the host lets the filter read it.
fn now() -> OffsetDateTime {
    OffsetDateTime::from(SystemTime::now())
}

#[shallot_guest::filter(name = "dynamic-context")]
impl Filter for DynamicContext {
    fn configure(&mut self) -> Result<(), String> {
        self.offset = Some(offset(&self.utc_offset).ok_or_else(|| {
            format!(
                "utc_offset '{}' is not an offset such as +08:00, -05:30 or Z",
                self.utc_offset
            )
        })?);
        if self.template.trim().is_empty() {
            return Err("template is empty".to_owned());
        }
        if now().year() < 2000 {
            return Err(
                "the clock reads 1970: grant it the real clock, `grants = { clock = true }`"
                    .to_owned(),
            );
        }
        Ok(())
    }

    fn system_prompt(&self, prompt: String) -> Result<String, FilterError> {
        let offset = self.offset.expect("configure parsed the offset");
        let line = self.render(now().to_offset(offset));
        Ok(match (prompt.is_empty(), self.position) {
            (true, _) => line,
            (false, Position::Append) => format!("{prompt}\n\n{line}"),
            (false, Position::Prepend) => format!("{line}\n\n{prompt}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_read_as_rfc_3339_writes_them() {
        assert_eq!(offset("Z"), Some(UtcOffset::UTC));
        assert_eq!(offset("+08:00"), UtcOffset::from_hms(8, 0, 0).ok());
        assert_eq!(offset("-05:30"), UtcOffset::from_hms(-5, -30, 0).ok());
        for bad in [
            "8", "+8:00", "+08", "08:00", "+24:00", "+25:00", "+05:60", "",
        ] {
            assert_eq!(offset(bad), None, "{bad}");
        }
    }
}
