//! `hold-release` (token): holds every token of a stream back; when the
//! stream ends, checks the whole text against the operator's rules, then
//! releases the original tokens in order with their metadata, or, when a
//! rule matches, one token with the `replacement` text instead (PEER-CASES
//! G3, G4). The answer itself (history, the turn's result) is unchanged: only
//! what the caller sees is held. A stream that fails releases nothing.
//!
//! Config: `{"words": ["secret"], "patterns": ["\\d{16}"], "case_sensitive":
//! false, "replacement": "[withheld]"}`.

use regex_lite::{Regex, RegexBuilder};
use serde::Deserialize;
use shallot_guest::{
    Filter, FilterError, FinishReason, HeldTokens, TokenOut, TokenTransform, Tokens,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldRelease {
    /// Words that block the answer.
    #[serde(default)]
    words: Vec<String>,
    /// Patterns that block the answer.
    #[serde(default)]
    patterns: Vec<String>,
    #[serde(default)]
    case_sensitive: bool,
    #[serde(default = "default_replacement")]
    replacement: String,
    #[serde(skip)]
    rules: Vec<Regex>,
}

fn default_replacement() -> String {
    "[withheld]".to_owned()
}

#[shallot_guest::filter(name = "hold-release")]
impl Filter for HoldRelease {
    fn configure(&mut self) -> Result<(), String> {
        for (i, pattern) in self.patterns.iter().enumerate() {
            let regex = RegexBuilder::new(pattern)
                .case_insensitive(!self.case_sensitive)
                .build()
                .map_err(|e| format!("patterns[{i}]: {e}"))?;
            if regex.is_match("") {
                return Err(format!("patterns[{i}] matches the empty string"));
            }
            self.rules.push(regex);
        }
        self.words.retain(|w| !w.is_empty());
        if !self.case_sensitive {
            for word in &mut self.words {
                *word = word.to_lowercase();
            }
        }
        Ok(())
    }

    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Held {
            words: self.words.clone(),
            case_sensitive: self.case_sensitive,
            rules: self.rules.clone(),
            replacement: self.replacement.clone(),
            tokens: HeldTokens::default(),
        })
    }
}

/// One stream's held tokens.
struct Held {
    words: Vec<String>,
    case_sensitive: bool,
    rules: Vec<Regex>,
    replacement: String,
    tokens: HeldTokens,
}

impl TokenTransform for Held {
    fn step(&mut self, tokens: Tokens, _: &mut TokenOut) -> Result<(), FilterError> {
        self.tokens.hold(&tokens);
        Ok(())
    }

    fn flush(&mut self, _: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        let text = self.tokens.text();
        let folded = if self.case_sensitive {
            text.clone()
        } else {
            text.to_lowercase()
        };
        let blocked = self.words.iter().any(|w| folded.contains(w.as_str()))
            || self.rules.iter().any(|rule| rule.is_match(&text));
        if blocked {
            out.push(&self.replacement, None);
        } else {
            self.tokens.release(out);
        }
        Ok(())
    }
}
