//! A model that answers from a script and records what it was asked.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::Value;
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message};
use shallot::{ChainError, ChatModel, Context, ModelEvent};

use crate::push;

/// One model reply of a script.
#[derive(Clone, Debug)]
pub enum Reply {
    /// Answers with this text (streamed as one token).
    Text(String),
    /// Streams these tokens (text, meta); the answer is their text joined.
    Tokens(Vec<(String, Option<String>)>),
    /// Fails with this error.
    Fail(ChainError),
    /// Streams these tokens, then (a moment later) the connection breaks.
    BreakAfter(Vec<String>, ChainError),
    /// Answers with the text after a pause.
    Slow(Duration, String),
    /// Answers with the text once the test lets it through the gate (a
    /// permit for each answer), for a request that must still be in
    /// progress when the test does something.
    Gated(Arc<tokio::sync::Semaphore>, String),
    /// Streams these tokens with a pause before each, so each arrives as
    /// its own batch, as from a real model.
    Paced(Vec<String>, Duration),
    /// Asks for these tool calls (name, arguments), with no text.
    Calls(Vec<(String, Value)>),
    /// Says this text (streamed as one token), then asks for these tool
    /// calls, as a model that announces what it is about to do.
    Preamble(String, Vec<(String, Value)>),
}

impl Reply {
    /// Asks for one call of `tool` with `arguments`.
    pub fn call(tool: &str, arguments: Value) -> Self {
        Reply::Calls(vec![(tool.to_owned(), arguments)])
    }

    /// Streams `tokens`, no metadata.
    pub fn tokens(tokens: &[&str]) -> Self {
        Reply::Tokens(tokens.iter().map(|t| (t.to_string(), None)).collect())
    }
}

type Script = Box<dyn Fn(usize, &ChatRequest) -> Reply + Send + Sync>;

struct ScriptState {
    script: Script,
    calls: AtomicUsize,
    /// The calls so far, for tests that wait for the model to be reached.
    reached: tokio::sync::watch::Sender<usize>,
    requests: Mutex<Vec<ChatRequest>>,
    trace: bool,
}

/// A model that answers from a script and records what it was asked.
/// Clones share the record.
#[derive(Clone)]
pub struct ScriptedModel {
    state: Arc<ScriptState>,
}

impl ScriptedModel {
    /// Answers call `n` (1-based) with `script(n, request)`.
    pub fn new(script: impl Fn(usize, &ChatRequest) -> Reply + Send + Sync + 'static) -> Self {
        ScriptedModel {
            state: Arc::new(ScriptState {
                script: Box::new(script),
                calls: AtomicUsize::new(0),
                reached: tokio::sync::watch::Sender::new(0),
                requests: Mutex::new(Vec::new()),
                trace: false,
            }),
        }
    }

    /// Always answers `text`.
    pub fn answer(text: &str) -> Self {
        let text = text.to_owned();
        Self::new(move |_, _| Reply::Text(text.clone()))
    }

    /// Answers the replies in order, then repeats the last.
    pub fn replies(replies: Vec<Reply>) -> Self {
        let replies: VecDeque<Reply> = replies.into();
        Self::new(move |n, _| {
            replies
                .get(n - 1)
                .or(replies.back())
                .cloned()
                .expect("a script has replies")
        })
    }

    /// Also appends "terminal" to the context list "trace" on every call.
    pub fn tracing(self) -> Self {
        let state =
            Arc::into_inner(self.state).expect("tracing() is set before the model is shared");
        ScriptedModel {
            state: Arc::new(ScriptState {
                trace: true,
                ..state
            }),
        }
    }

    /// How many times it was called.
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// Waits until it has been called `n` times: a test's way to know a
    /// request reached the model, instead of sleeping for it.
    pub async fn reached(&self, n: usize) {
        let mut calls = self.state.reached.subscribe();
        calls
            .wait_for(|calls| *calls >= n)
            .await
            .expect("the model lives as long as this handle");
    }

    /// The requests it received, in order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.state.requests.lock().unwrap().clone()
    }

    fn next(&self, request: &ChatRequest, context: &Context) -> (usize, Reply) {
        let n = self.state.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.requests.lock().unwrap().push(request.clone());
        self.state.reached.send_replace(n);
        if self.state.trace {
            push(context, "trace", "terminal");
        }
        (n, (self.state.script)(n, request))
    }
}

/// A response asking for tool calls after `text`.
fn preamble(n: usize, text: String, asked: Vec<(String, Value)>) -> ChatResponse {
    let mut response = calls(n, asked);
    response.message.content = Some(shallot::types::Content::Text(text));
    response
}

/// A response asking for tool calls; ids are `call-<n>-<i>` for call `n` of the model.
fn calls(n: usize, calls: Vec<(String, Value)>) -> ChatResponse {
    let tool_calls = calls
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| shallot::types::ToolCall {
            id: format!("call-{n}-{i}"),
            name,
            arguments: arguments.to_string(),
        })
        .collect();
    let message = Message {
        role: shallot::types::Role::Assistant,
        content: None,
        tool_calls,
        tool_call_id: None,
    };
    let mut response = ChatResponse::new(message, FinishReason::ToolUse);
    response.model = "scripted".to_owned();
    response
}

fn response(text: String) -> ChatResponse {
    let mut response = ChatResponse::new(Message::assistant(text), FinishReason::Complete);
    response.model = "scripted".to_owned();
    response
}

#[async_trait]
impl ChatModel for ScriptedModel {
    fn name(&self) -> &str {
        "scripted"
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        match self.next(request, context) {
            (n, Reply::Calls(asked)) => Ok(calls(n, asked)),
            (n, Reply::Preamble(text, asked)) => Ok(preamble(n, text, asked)),
            (_, Reply::Text(text)) => Ok(response(text)),
            (_, Reply::Tokens(tokens)) => {
                Ok(response(tokens.into_iter().map(|(t, _)| t).collect()))
            }
            (_, Reply::Paced(tokens, _)) => Ok(response(tokens.concat())),
            (_, Reply::Fail(error) | Reply::BreakAfter(_, error)) => Err(error),
            (_, Reply::Slow(pause, text)) => {
                tokio::time::sleep(pause).await;
                Ok(response(text))
            }
            (_, Reply::Gated(gate, text)) => {
                gate.acquire().await.expect("the gate stays").forget();
                Ok(response(text))
            }
        }
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        fn token((text, meta): (String, Option<String>)) -> Result<ModelEvent, ChainError> {
            Ok(ModelEvent::Token { text, meta })
        }
        let (n, reply) = self.next(request, context);
        Ok(match reply {
            Reply::Calls(asked) => stream::iter([Ok(ModelEvent::Done(calls(n, asked)))]).boxed(),
            Reply::Preamble(text, asked) => stream::iter([
                token((text.clone(), None)),
                Ok(ModelEvent::Done(preamble(n, text, asked))),
            ])
            .boxed(),
            Reply::Text(text) => stream::iter([
                token((text.clone(), None)),
                Ok(ModelEvent::Done(response(text))),
            ])
            .boxed(),
            Reply::Tokens(tokens) => {
                let done = response(tokens.iter().map(|(t, _)| t.as_str()).collect());
                stream::iter(
                    tokens
                        .into_iter()
                        .map(token)
                        .chain([Ok(ModelEvent::Done(done))]),
                )
                .boxed()
            }
            Reply::Fail(error) => return Err(error),
            Reply::BreakAfter(tokens, error) => {
                // The break comes a moment after the tokens, so they arrive
                // (and are delivered) first, as from a real connection.
                let broken = stream::once(async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Err(error)
                });
                stream::iter(tokens.into_iter().map(|t| token((t, None))))
                    .chain(broken)
                    .boxed()
            }
            Reply::Paced(tokens, pause) => {
                let done = response(tokens.concat());
                let paced = stream::iter(tokens).then(move |text| async move {
                    tokio::time::sleep(pause).await;
                    token((text, None))
                });
                paced
                    .chain(stream::iter([Ok(ModelEvent::Done(done))]))
                    .boxed()
            }
            Reply::Slow(pause, text) => stream::once(async move {
                tokio::time::sleep(pause).await;
                Ok(ModelEvent::Done(response(text)))
            })
            .boxed(),
            Reply::Gated(gate, text) => stream::once(async move {
                gate.acquire().await.expect("the gate stays").forget();
                Ok(ModelEvent::Done(response(text)))
            })
            .boxed(),
        })
    }
}
