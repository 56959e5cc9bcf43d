//! The built-in demo tools: `calculator`, `clock` and `echo`.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::ToolRegistry;
use crate::types::ToolSpec;
use crate::types::{ChainError, ErrorKind};

/// Registers the built-in tools.
pub fn register(tools: &mut ToolRegistry) {
    tools.register(
        ToolSpec::new(
            "calculator",
            "Evaluates an arithmetic expression with + - * / % ^ and parentheses.",
            json!({
                "type": "object",
                "properties": { "expression": { "type": "string", "description": "e.g. (2 + 3) * 4" } },
                "required": ["expression"],
                "additionalProperties": false
            }),
        ),
        |args: Value, _| async move {
            let expression = args["expression"].as_str().unwrap_or_default();
            calculate(expression)
                .map(number)
                .map_err(|e| ChainError::new(ErrorKind::InvalidRequest, format!("cannot evaluate {expression:?}: {e}")))
        },
    );
    tools.register(
        ToolSpec::new(
            "clock",
            "Tells the current date and time in UTC.",
            json!({ "type": "object", "properties": {}, "additionalProperties": false }),
        ),
        |_, _| async move {
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            Ok(json!({ "utc": utc(unix), "unix": unix }))
        },
    );
    tools.register(
        ToolSpec::new(
            "echo",
            "Returns the text it is given.",
            json!({
                "type": "object",
                "properties": { "text": { "type": "string" } },
                "required": ["text"]
            }),
        ),
        |args: Value, _| async move { Ok(args["text"].clone()) },
    );
}

/// A whole number as an integer, anything else as a float.
fn number(value: f64) -> Value {
    if value.fract() == 0.0 && value.abs() < 9.0e15 {
        json!(value as i64)
    } else {
        json!(value)
    }
}

/// Evaluates an arithmetic expression.
pub fn calculate(expression: &str) -> Result<f64, String> {
    let mut parser = Parser {
        chars: expression.chars().filter(|c| !c.is_whitespace()).collect(),
        at: 0,
    };
    let value = parser.sum()?;
    match parser.peek() {
        None if value.is_finite() => Ok(value),
        None => Err("the result is not a finite number".to_owned()),
        Some(c) => Err(format!("unexpected {c:?}")),
    }
}

struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        let found = self.peek() == Some(c);
        self.at += found as usize;
        found
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        loop {
            if self.eat('+') {
                value += self.product()?;
            } else if self.eat('-') {
                value -= self.product()?;
            } else {
                return Ok(value);
            }
        }
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.power()?;
        loop {
            if self.eat('*') {
                value *= self.power()?;
            } else if self.eat('/') {
                let divisor = self.power()?;
                if divisor == 0.0 {
                    return Err("division by zero".to_owned());
                }
                value /= divisor;
            } else if self.eat('%') {
                value %= self.power()?;
            } else {
                return Ok(value);
            }
        }
    }

    fn power(&mut self) -> Result<f64, String> {
        let base = self.unary()?;
        if self.eat('^') {
            Ok(base.powf(self.power()?))
        } else {
            Ok(base)
        }
    }

    fn unary(&mut self) -> Result<f64, String> {
        if self.eat('-') {
            return Ok(-self.unary()?);
        }
        if self.eat('+') {
            return self.unary();
        }
        if self.eat('(') {
            let value = self.sum()?;
            return if self.eat(')') {
                Ok(value)
            } else {
                Err("missing ')'".to_owned())
            };
        }
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit() || c == '.') {
            self.at += 1;
        }
        let digits: String = self.chars[start..self.at].iter().collect();
        match (digits.is_empty(), self.peek()) {
            (true, Some(c)) => Err(format!("unexpected {c:?}")),
            (true, None) => Err("unexpected end".to_owned()),
            _ => digits.parse().map_err(|_| format!("bad number {digits:?}")),
        }
    }
}

/// `unix` seconds as an RFC 3339 UTC timestamp.
fn utc(unix: u64) -> String {
    let (days, seconds) = (unix / 86_400, unix % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let (h, m, s) = (seconds / 3600, seconds % 3600 / 60, seconds % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_follows_precedence_and_parentheses() {
        assert_eq!(calculate("2 + 3 * 4"), Ok(14.0));
        assert_eq!(calculate("(2 + 3) * 4"), Ok(20.0));
        assert_eq!(calculate("2 ^ 3 ^ 2"), Ok(512.0));
        assert_eq!(calculate("-3 + 10 / 4"), Ok(-0.5));
    }

    #[test]
    fn bad_expressions_are_errors() {
        assert!(calculate("1 / 0").is_err());
        assert!(calculate("2 +").is_err());
        assert!(calculate("(1").is_err());
        assert!(calculate("two").is_err());
    }

    #[test]
    fn timestamps_are_utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(1_795_910_400), "2026-11-29T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
    }
}
