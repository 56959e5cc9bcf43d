//! The token transform chain: what the caller's sink sees of a model stream.
//!
//! For each model stream (so each round of the tool loop, and each `next`
//! a chat filter makes) every filter with a token transform gets a fresh
//! transformer. Tokens go through them in filter order: the first filter
//! sees the raw tokens, whatever leaves the last reaches the sink. Each
//! step takes a batch and returns 0..N tokens per token.
//!
//! When the stream ends normally, flush cascades: for each layer in order,
//! its leftovers go through the later layers' `step` and on to the sink,
//! then the next layer flushes. When the stream fails nothing is flushed:
//! buffered tokens are dropped, so half an answer never leaks.
//!
//! The chain changes delivery only: the response the chain returns (and
//! that memory and the tool loop use) is the model's original. With no
//! transforms the sink gets the tokens directly.
//!
//! One word for the concept: a *token transform* (the `token-transform`
//! hook, and [`TokenTransform`] for one stream's). The WIT contract also
//! calls its interface `token-filter` and the per-stream resource
//! `token-transformer`; those names stay as they are, since components are
//! built against them.

use std::sync::Arc;

use async_trait::async_trait;

use super::{FilterScope, Invoke};
use crate::types::{ChainError, FinishReason, Token, TokenBatch};

/// Where a streaming caller receives tokens.
pub trait TokenSink: Send + Sync {
    /// Receives the next tokens, in stream order.
    fn deliver(&self, tokens: &TokenBatch);
}

impl<F> TokenSink for F
where
    F: Fn(Token<'_>) + Send + Sync,
{
    fn deliver(&self, tokens: &TokenBatch) {
        for token in tokens.iter() {
            self(token)
        }
    }
}

/// A token transform for one model stream: a native filter's, or a wasm
/// filter's transformer resource in its instance.
#[async_trait]
pub trait TokenTransform: Send {
    /// Takes the next tokens and returns 0..N tokens for each.
    async fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError>;

    /// The stream ended normally, the model having stopped for `end`
    /// (`ToolUse` for a round that asks for tools): returns what is still
    /// buffered.
    async fn flush(&mut self, end: FinishReason) -> Result<TokenBatch, ChainError> {
        let _ = end;
        Ok(TokenBatch::default())
    }

    /// The stream is over (finished or abandoned): releases what the
    /// transform holds.
    async fn close(self: Box<Self>) {}
}

/// The transforms of one model stream, feeding the caller's sink. Holds
/// its invoke (and so its instances) until finished or dropped.
pub struct TokenStream {
    layers: Vec<Box<dyn TokenTransform>>,
    sink: Arc<dyn TokenSink>,
    _invoke: Arc<Invoke>,
}

impl TokenStream {
    /// Fresh transformers for a new stream of `invoke`.
    pub(crate) async fn open(
        invoke: &Arc<Invoke>,
        sink: Arc<dyn TokenSink>,
    ) -> Result<Self, ChainError> {
        let onion = invoke.onion();
        let mut layers = Vec::with_capacity(onion.token_layers.len());
        for &id in &onion.token_layers {
            let scope = FilterScope::new(invoke.clone(), id);
            if let Some(transform) = onion.filters[id].filter.token_transform(&scope).await? {
                layers.push(transform);
            }
        }
        Ok(TokenStream {
            layers,
            sink,
            _invoke: invoke.clone(),
        })
    }

    /// Sends `tokens` through every transform to the sink.
    pub async fn push(&mut self, tokens: TokenBatch) -> Result<(), ChainError> {
        let out = Self::through(&mut self.layers, tokens).await?;
        if !out.is_empty() {
            self.sink.deliver(&out);
        }
        Ok(())
    }

    async fn through(
        layers: &mut [Box<dyn TokenTransform>],
        mut tokens: TokenBatch,
    ) -> Result<TokenBatch, ChainError> {
        for layer in layers {
            if tokens.is_empty() {
                break;
            }
            tokens = layer.step(tokens).await?;
        }
        Ok(tokens)
    }

    /// The stream ended normally, the model having stopped for `end`: the
    /// flush cascade, then the transformers are released.
    pub async fn finish(mut self, end: FinishReason) -> Result<(), ChainError> {
        for i in 0..self.layers.len() {
            let (done, rest) = self.layers.split_at_mut(i + 1);
            let residue = done[i].flush(end).await?;
            let out = Self::through(rest, residue).await?;
            if !out.is_empty() {
                self.sink.deliver(&out);
            }
        }
        self.release().await;
        Ok(())
    }

    /// The stream failed: drops whatever the transforms buffered, unseen.
    pub async fn abandon(self) {
        self.release().await
    }

    async fn release(self) {
        for layer in self.layers {
            layer.close().await;
        }
    }
}
