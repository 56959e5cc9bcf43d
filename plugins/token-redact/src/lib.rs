//! `token-redact`: replaces a pattern in the streamed tokens, so the caller
//! never sees it. The answer itself (history, tool loop) keeps the original.
//!
//! A secret the model emits is often split across tokens (`sk-a`, `bc12`,
//! `3`). The filter holds back the last `window` characters of the stream
//! until it knows they cannot start a match, so a secret up to `window`
//! characters long is caught however it is split. Set `window` to 0 to
//! match within each batch only (no delay, but a split secret can leak).
//!
//! Config: `{"pattern": "sk-\\w+", "replacement": "[KEY]", "window": 64}`.
//! Patterns use `regex-lite` syntax (`\w`, `\d` and `\s` are ASCII).

use std::ops::Range;

use regex_lite::Regex;
use serde::Deserialize;
use shallot_guest::{Filter, FilterError, FinishReason, TokenOut, TokenTransform, Tokens};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Redact {
    pattern: String,
    #[serde(default = "default_replacement")]
    replacement: String,
    #[serde(default = "default_window")]
    window: usize,
    #[serde(skip)]
    regex: Option<Regex>,
}

fn default_replacement() -> String {
    "[REDACTED]".to_owned()
}

fn default_window() -> usize {
    64
}

#[shallot_guest::filter(name = "token-redact")]
impl Filter for Redact {
    fn configure(&mut self) -> Result<(), String> {
        let regex = Regex::new(&self.pattern).map_err(|e| format!("pattern: {e}"))?;
        if regex.is_match("") {
            return Err("pattern matches the empty string".to_owned());
        }
        self.regex = Some(regex);
        Ok(())
    }

    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Redactor {
            regex: self.regex.clone().expect("configure compiled the pattern"),
            replacement: self.replacement.clone(),
            window: self.window,
            held: Vec::new(),
        })
    }
}

/// One stream's redaction state: the tokens not yet safe to emit.
struct Redactor {
    regex: Regex,
    replacement: String,
    window: usize,
    held: Vec<(String, Option<String>)>,
}

impl TokenTransform for Redactor {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        self.held.extend(
            tokens
                .iter()
                .map(|t| (t.text.to_owned(), t.meta.map(str::to_owned))),
        );
        self.emit(out, false);
        Ok(())
    }

    fn flush(&mut self, _: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        self.emit(out, true);
        Ok(())
    }
}

impl Redactor {
    /// Emits the held text up to the point where no match can still be
    /// growing (everything, at the end of the stream), redacted, in the
    /// original token pieces.
    fn emit(&mut self, out: &mut TokenOut, end_of_stream: bool) {
        let text: String = self.held.iter().map(|(t, _)| t.as_str()).collect();
        let matches: Vec<Range<usize>> = self.regex.find_iter(&text).map(|m| m.range()).collect();
        let mut cut = if end_of_stream {
            text.len()
        } else {
            self.safe_end(&text)
        };
        // Never cut through a match: hold all of it back.
        if let Some(m) = matches.iter().find(|m| m.start < cut && cut < m.end) {
            cut = m.start;
        }
        let mut start = 0;
        let mut rest = Vec::new();
        for (token, meta) in std::mem::take(&mut self.held) {
            let end = start + token.len();
            if start >= cut {
                rest.push((token, meta));
            } else {
                let piece = redact(&text, start..end.min(cut), &matches, &self.replacement);
                if !piece.is_empty() {
                    out.push(&piece, meta.as_deref());
                }
                if end > cut {
                    rest.push((text[cut..end].to_owned(), None));
                }
            }
            start = end;
        }
        self.held = rest;
    }

    /// The byte offset `window` characters before the end.
    fn safe_end(&self, text: &str) -> usize {
        if self.window == 0 {
            return text.len();
        }
        text.char_indices()
            .rev()
            .nth(self.window - 1)
            .map_or(0, |(i, _)| i)
    }
}

/// The text of `range` with every match replaced; a match's replacement
/// goes where the match starts.
fn redact(text: &str, range: Range<usize>, matches: &[Range<usize>], replacement: &str) -> String {
    let mut piece = String::new();
    let mut at = range.start;
    for m in matches
        .iter()
        .filter(|m| m.start < range.end && m.end > range.start)
    {
        if m.start > at {
            piece.push_str(&text[at..m.start]);
        }
        if m.start >= range.start {
            piece.push_str(replacement);
        }
        at = at.max(m.end.min(range.end));
    }
    if at < range.end {
        piece.push_str(&text[at..range.end]);
    }
    piece
}
