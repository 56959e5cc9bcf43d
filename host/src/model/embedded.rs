//! The embedded default model: offline and deterministic, for the demo and
//! for tests. It answers by echoing the latest user message, streamed in
//! word-sized tokens (long words in 4-character pieces, as real tokenizers
//! split them), optionally paced so a terminal shows the stream.

use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};

use super::{ChatModel, ModelEvent};
use crate::context::Context;
use crate::error::ChainError;
use crate::types::{ChatRequest, ChatResponse, FinishReason, Message, Role, Usage};

/// The embedded default model (`shallot-echo`).
#[derive(Debug, Clone, Default)]
pub struct EmbeddedModel {
    delay: Duration,
}

impl EmbeddedModel {
    /// The model, streaming without delay.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits `delay` before each streamed token.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    fn answer(request: &ChatRequest) -> String {
        let last = request
            .messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .map(Message::text);
        match last {
            Some(text) if !text.trim().is_empty() => format!("You said: {}", text.trim()),
            _ => {
                "Hello! I am shallot's embedded model; say something and I will echo it.".to_owned()
            }
        }
    }

    fn respond(request: &ChatRequest, text: String, tokens: usize) -> ChatResponse {
        let input: usize = request
            .messages
            .iter()
            .map(|m| m.text().len().div_ceil(4))
            .sum();
        let mut response = ChatResponse::new(Message::assistant(text), FinishReason::Complete);
        response.model = "shallot-echo".to_owned();
        response.usage = Usage {
            input_tokens: input as u32,
            output_tokens: tokens as u32,
            total_tokens: (input + tokens) as u32,
        };
        response
    }
}

/// Splits `text` into tokens: words with their trailing space, words longer
/// than six characters in pieces of four.
pub(crate) fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    for word in text.split_inclusive(' ') {
        let chars: Vec<char> = word.chars().collect();
        if chars.len() <= 6 {
            tokens.push(word.to_owned());
        } else {
            tokens.extend(
                chars
                    .chunks(4)
                    .map(|piece| piece.iter().collect::<String>()),
            );
        }
    }
    tokens
}

#[async_trait]
impl ChatModel for EmbeddedModel {
    fn name(&self) -> &str {
        "shallot-echo"
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        _context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let text = Self::answer(request);
        let count = tokenize(&text).len();
        Ok(Self::respond(request, text, count))
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        _context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let text = Self::answer(request);
        let tokens = tokenize(&text);
        let done = Self::respond(request, text, tokens.len());
        let delay = self.delay;
        let tokens = stream::iter(tokens).then(move |text| async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            Ok(ModelEvent::Token { text, meta: None })
        });
        Ok(tokens
            .chain(stream::once(async move { Ok(ModelEvent::Done(done)) }))
            .boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_rejoin_into_the_text() {
        let text = "You said: my key is sk-abc123def ok";
        assert_eq!(tokenize(text).concat(), text);
    }

    #[test]
    fn long_words_split_into_four_character_pieces() {
        assert_eq!(tokenize("sk-abc123 ok"), ["sk-a", "bc12", "3 ", "ok"]);
    }
}
