//! The streaming token transform: tokens in, 0..N tokens out, per stream.

use crate::bindings::shallot::filter::model_stream;
use crate::bindings::shallot::filter::types::{TokenBatch, TokenMeta};
use crate::{FilterError, FinishReason};

/// One streamed token: its text and optional metadata (a JSON object).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token<'a> {
    pub text: &'a str,
    pub meta: Option<&'a str>,
}

/// A batch of tokens handed to [`TokenTransform::step`], in stream order.
pub struct Tokens {
    batch: TokenBatch,
}

impl Tokens {
    pub(crate) fn new(batch: TokenBatch) -> Self {
        Self { batch }
    }

    /// Number of tokens in the batch.
    pub fn len(&self) -> usize {
        self.batch.ends.len()
    }

    /// Whether the batch has no tokens.
    pub fn is_empty(&self) -> bool {
        self.batch.ends.is_empty()
    }

    /// The text of every token, back to back.
    pub fn text(&self) -> &str {
        &self.batch.text
    }

    /// The tokens, in order.
    pub fn iter(&self) -> impl Iterator<Item = Token<'_>> {
        let mut metas = self.batch.metas.iter().peekable();
        let mut start = 0usize;
        self.batch
            .ends
            .iter()
            .enumerate()
            .map(move |(index, &end)| {
                let end = end as usize;
                let text = &self.batch.text[start..end];
                start = end;
                let meta = match metas.peek() {
                    Some(m) if m.index as usize == index => metas.next().map(|m| m.json.as_str()),
                    _ => None,
                };
                Token { text, meta }
            })
    }
}

/// Where a transform writes the tokens it emits.
pub struct TokenOut {
    batch: TokenBatch,
}

impl Default for TokenOut {
    fn default() -> Self {
        TokenOut {
            batch: TokenBatch {
                text: String::new(),
                ends: Vec::new(),
                metas: Vec::new(),
            },
        }
    }
}

impl TokenOut {
    /// Emits one token.
    pub fn push(&mut self, text: &str, meta: Option<&str>) {
        if let Some(json) = meta {
            self.batch.metas.push(TokenMeta {
                index: self.batch.ends.len() as u32,
                json: json.to_owned(),
            });
        }
        self.batch.text.push_str(text);
        self.batch.ends.push(self.batch.text.len() as u32);
    }

    /// Emits a token unchanged.
    pub fn push_token(&mut self, token: Token<'_>) {
        self.push(token.text, token.meta)
    }

    /// Emits a whole batch unchanged (without copying when nothing was
    /// emitted before it).
    pub fn push_all(&mut self, tokens: Tokens) {
        if self.batch.ends.is_empty() {
            self.batch = tokens.batch;
        } else {
            for token in tokens.iter() {
                self.push_token(token);
            }
        }
    }

    /// Number of tokens emitted so far.
    pub fn len(&self) -> usize {
        self.batch.ends.len()
    }

    /// Whether nothing was emitted yet.
    pub fn is_empty(&self) -> bool {
        self.batch.ends.is_empty()
    }

    pub(crate) fn into_batch(self) -> TokenBatch {
        self.batch
    }
}

/// Tokens a transform holds back, in order with their metadata, to
/// release later as they were (or to drop, or replace).
#[derive(Debug, Default)]
pub struct HeldTokens(Vec<(String, Option<String>)>);

impl HeldTokens {
    /// Holds every token of `tokens`.
    pub fn hold(&mut self, tokens: &Tokens) {
        self.0.extend(
            tokens
                .iter()
                .map(|t| (t.text.to_owned(), t.meta.map(str::to_owned))),
        );
    }

    /// The text held, joined.
    pub fn text(&self) -> String {
        self.0.iter().map(|(text, _)| text.as_str()).collect()
    }

    /// Emits the held tokens as they came, and holds none.
    pub fn release(&mut self, out: &mut TokenOut) {
        for (text, meta) in self.0.drain(..) {
            out.push(&text, meta.as_deref());
        }
    }
}

/// A token transform for one model stream. It may keep state in `self`
/// (a buffer, a window): a fresh value is made for every stream.
pub trait TokenTransform {
    /// Takes the next tokens of the stream and emits 0..N tokens for them:
    /// drop, pass, expand, or buffer them for a later step or `flush`.
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError>;

    /// The stream ended normally, the model having stopped for `end`
    /// (e.g. [`FinishReason::ToolUse`] for a round of the tool loop that
    /// asks for tools rather than answering): emit whatever is still
    /// buffered. Not called when the stream fails, so buffered tokens
    /// never leak then.
    fn flush(&mut self, end: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        let _ = (end, out);
        Ok(())
    }
}

/// The identity transform.
pub struct PassThrough;

impl TokenTransform for PassThrough {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        out.push_all(tokens);
        Ok(())
    }
}

/// Why the model stopped, for [`TokenTransform::flush`]: the host says it
/// before every flush.
pub(crate) fn stream_end() -> FinishReason {
    model_stream::end().unwrap_or(FinishReason::Complete)
}
