//! The embedded default model: offline and deterministic, for the demo and
//! for tests. It echoes the latest user message, except that it calls the
//! tools it is offered when a message asks for them: any tool by name for
//! `call TOOL {"json": "arguments"}` (an MCP server's, say), the
//! `calculator` for an arithmetic expression, the `clock` for the time or
//! date; given the tool results, it reports them. Text is streamed in word-sized tokens (long
//! words in 4-character pieces, as real tokenizers split them), optionally
//! paced so a terminal shows the stream.

use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::{Value, json};

use super::{ChatModel, ModelEvent};
use crate::context::Context;
use crate::types::{ChainError, ErrorKind};
use crate::types::{ChatRequest, ChatResponse, FinishReason, Message, Role, ToolCall, Usage};
use crate::types::{
    Embedding, EmbeddingInput, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, Vector,
};

/// The embedded default model (`shallot-echo`).
#[derive(Debug, Clone, Default)]
pub struct EmbeddedModel {
    delay: Duration,
}

/// What the model decided to do.
enum Answer {
    Text(String),
    Call(ToolCall),
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

    fn answer(request: &ChatRequest) -> Answer {
        let offered = |name: &str| request.tools.iter().any(|t| t.name == name);
        let Some(last) = request.messages.last() else {
            return Answer::Text(
                "Hello! I am shallot's embedded model; say something and I will echo it."
                    .to_owned(),
            );
        };
        if last.role == Role::Tool {
            return Answer::Text(report(&request.messages));
        }
        let text = last.text();
        let call = |name: &str, arguments: serde_json::Value| {
            let rounds = request
                .messages
                .iter()
                .filter(|m| m.role == Role::Assistant)
                .count();
            Answer::Call(ToolCall {
                id: format!("call-{}", rounds + 1),
                name: name.to_owned(),
                arguments: arguments.to_string(),
            })
        };
        if last.role == Role::User {
            if let Some((tool, arguments)) = asked_to_call(&text).filter(|(t, _)| offered(t)) {
                return call(tool, arguments);
            }
            if let Some(expression) = arithmetic(&text).filter(|_| offered("calculator")) {
                return call("calculator", json!({ "expression": expression }));
            }
            let lower = text.to_lowercase();
            if offered("clock") && ["time", "date", "clock"].iter().any(|w| lower.contains(w)) {
                return call("clock", json!({}));
            }
        }
        match text.trim() {
            "" => Answer::Text(
                "Hello! I am shallot's embedded model; say something and I will echo it."
                    .to_owned(),
            ),
            said => Answer::Text(format!("You said: {said}")),
        }
    }

    fn respond(
        request: &ChatRequest,
        message: Message,
        finish: FinishReason,
        tokens: usize,
    ) -> ChatResponse {
        let input: usize = request
            .messages
            .iter()
            .map(|m| m.text().len().div_ceil(4))
            .sum();
        let mut response = ChatResponse::new(message, finish);
        response.model = "shallot-echo".to_owned();
        response.usage = Usage {
            input_tokens: input as u32,
            output_tokens: tokens as u32,
            total_tokens: (input + tokens) as u32,
        };
        response
    }

    fn tool_call(request: &ChatRequest, call: ToolCall) -> ChatResponse {
        let message = Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![call],
            tool_call_id: None,
        };
        Self::respond(request, message, FinishReason::ToolUse, 1)
    }
}

/// The longest run of an arithmetic expression in `text` (digits, operators,
/// parentheses), if it has an operator.
fn arithmetic(text: &str) -> Option<String> {
    let arithmetic_char = |c: char| c.is_ascii_digit() || "+-*/%^(). ".contains(c);
    text.split(|c: char| !arithmetic_char(c))
        .map(str::trim)
        .filter(|run| {
            run.chars().any(|c| c.is_ascii_digit()) && run.chars().any(|c| "+-*/%^".contains(c))
        })
        .max_by_key(|run| run.len())
        .map(str::to_owned)
}

/// `call TOOL {arguments}` (the arguments a JSON object, or nothing):
/// the tool and its arguments.
fn asked_to_call(text: &str) -> Option<(&str, Value)> {
    let rest = text.trim().strip_prefix("call ")?.trim_start();
    let (tool, arguments) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let arguments = match arguments.trim() {
        "" => json!({}),
        given => serde_json::from_str(given).ok().filter(Value::is_object)?,
    };
    Some((tool, arguments))
}

/// An answer reporting the tool results after the last tool-calling message.
fn report(messages: &[Message]) -> String {
    let Some(asked) = messages.iter().rposition(|m| !m.tool_calls.is_empty()) else {
        return "Done.".to_owned();
    };
    let lines: Vec<String> = messages[asked + 1..]
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|result| {
            let name = messages[asked]
                .tool_calls
                .iter()
                .find(|c| Some(&c.id) == result.tool_call_id.as_ref())
                .map_or("the tool", |c| c.name.as_str());
            format!("{name} says {}", result.text())
        })
        .collect();
    format!("{}.", lines.join("; "))
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
        Ok(match Self::answer(request) {
            Answer::Call(call) => Self::tool_call(request, call),
            Answer::Text(text) => {
                let count = tokenize(&text).len();
                Self::respond(
                    request,
                    Message::assistant(text),
                    FinishReason::Complete,
                    count,
                )
            }
        })
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        _context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let text = match Self::answer(request) {
            Answer::Call(call) => {
                let done = Self::tool_call(request, call);
                return Ok(stream::iter([Ok(ModelEvent::Done(done))]).boxed());
            }
            Answer::Text(text) => text,
        };
        let tokens = tokenize(&text);
        let done = Self::respond(
            request,
            Message::assistant(text),
            FinishReason::Complete,
            tokens.len(),
        );
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

    /// A deterministic embedding of each text: 16 numbers from its
    /// SHA-256, of length 1, as numbers or (`"encoding_format": "base64"`)
    /// as OpenAI's base64. Not a meaning, but the same text always gets the
    /// same vector, for the demo and for tests. Token ids it cannot read.
    async fn embed(
        &self,
        request: &EmbeddingRequest,
        _context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        let texts: Vec<&str> = match &request.input {
            EmbeddingInput::Text(text) => vec![text],
            EmbeddingInput::Texts(texts) => texts.iter().map(String::as_str).collect(),
            EmbeddingInput::Tokens(_) | EmbeddingInput::TokenLists(_) => {
                return Err(ChainError::new(
                    ErrorKind::InvalidRequest,
                    "the embedded model embeds a string or a list of strings, not token ids",
                ));
            }
        };
        let data = texts
            .iter()
            .zip(0..)
            .map(|(text, index)| {
                let vector = vector(text);
                let embedding = if request.base64() {
                    // As OpenAI sends it: the little-endian f32s, in base64.
                    use base64::Engine;
                    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    Vector::Floats(vector.into_iter().map(f64::from).collect())
                };
                Embedding {
                    object: "embedding".to_owned(),
                    index,
                    embedding,
                }
            })
            .collect();
        let tokens = texts
            .iter()
            .map(|t| t.split_whitespace().count())
            .sum::<usize>();
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        Ok(EmbeddingResponse {
            object: "list".to_owned(),
            data,
            model: self.name().to_owned(),
            usage: EmbeddingUsage {
                prompt_tokens: tokens,
                total_tokens: tokens,
            },
        })
    }
}

/// 16 numbers of `text`'s SHA-256, scaled to a vector of length 1.
fn vector(text: &str) -> Vec<f32> {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(text.as_bytes());
    let raw: Vec<f32> = digest[..16].iter().map(|b| f32::from(*b) - 127.5).collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    raw.iter().map(|x| x / norm).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ToolSpec;

    #[test]
    fn tokens_rejoin_into_the_text() {
        let text = "You said: my key is sk-abc123def ok";
        assert_eq!(tokenize(text).concat(), text);
    }

    #[test]
    fn long_words_split_into_four_character_pieces() {
        assert_eq!(tokenize("sk-abc123 ok"), ["sk-a", "bc12", "3 ", "ok"]);
    }

    #[test]
    fn an_expression_calls_the_calculator_only_when_it_is_offered() {
        let ask = ChatRequest::new(vec![Message::user("What is (2 + 3) * 4?")]);
        assert!(matches!(EmbeddedModel::answer(&ask), Answer::Text(_)));
        let calculator = ToolSpec::new("calculator", "", json!({}));
        let ask = ask.with_tools(vec![calculator]);
        let Answer::Call(call) = EmbeddedModel::answer(&ask) else {
            panic!("expected a tool call")
        };
        assert_eq!(call.name, "calculator");
        assert_eq!(call.arguments, r#"{"expression":"(2 + 3) * 4"}"#);
    }

    #[test]
    fn call_names_any_offered_tool_with_json_arguments() {
        let offered = |text: &str| {
            let echo = ToolSpec::new("files_read", "", json!({}));
            ChatRequest::new(vec![Message::user(text)]).with_tools(vec![echo])
        };
        let Answer::Call(call) =
            EmbeddedModel::answer(&offered(r#"call files_read {"path": "a"}"#))
        else {
            panic!("expected a tool call")
        };
        assert_eq!(
            (call.name.as_str(), call.arguments.as_str()),
            ("files_read", r#"{"path":"a"}"#)
        );
        for not_a_call in [
            "call files_read [1]",
            "call other {}",
            "call files_read {oops",
        ] {
            assert!(
                matches!(EmbeddedModel::answer(&offered(not_a_call)), Answer::Text(_)),
                "{not_a_call}"
            );
        }
        let Answer::Call(call) = EmbeddedModel::answer(&offered("call files_read")) else {
            panic!("expected a tool call")
        };
        assert_eq!(call.arguments, "{}");
    }

    #[test]
    fn tool_results_are_reported() {
        let call = ToolCall {
            id: "call-1".into(),
            name: "calculator".into(),
            arguments: "{}".into(),
        };
        let asked = Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![call],
            tool_call_id: None,
        };
        let request = ChatRequest::new(vec![
            Message::user("2+2"),
            asked,
            Message::tool_result("call-1", "4"),
        ]);
        let Answer::Text(text) = EmbeddedModel::answer(&request) else {
            panic!("expected text")
        };
        assert_eq!(text, "calculator says 4.");
    }
}
