//! What shallot's end-to-end tests and benchmarks share: where the built
//! guests are, one engine per process, a scriptable model, a recording
//! token sink.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::Value;
use shallot::plugin::FilterSpec;
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message, TokenBatch};
use shallot::{
    ChainError, ChatModel, Context, Engine, EngineConfig, Isolation, ModelEvent, PluginSet,
    TokenSink,
};

/// The target directory this build uses (`CARGO_TARGET_DIR`, relative or
/// not, or the workspace's `target/`): the one the running test or bench
/// binary is in (`<target>/<profile>/deps/<binary>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<binary>")
        .into()
}

/// The built guest component `name` (a plugin or a test guest).
pub fn guest(name: &str) -> PathBuf {
    let path = target_dir()
        .join("wasm32-wasip2")
        .join("guest")
        .join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: build the guests first with `cargo build-guests` (needs `rustup target add wasm32-wasip2`) and, for the Python and JavaScript ones, `scripts/build-polyglot`",
        path.display()
    );
    path
}

/// One engine for the whole test process, with a compile cache under the
/// target directory so each guest compiles once per machine.
pub fn engine() -> Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let config = EngineConfig {
                cache_dir: Some(target_dir().join("shallot-test-cache")),
                ..EngineConfig::default()
            };
            Engine::new(config).expect("the engine starts")
        })
        .clone()
}

/// A filter of guest `plugin`, named `name`, configured with `config`.
pub fn spec(plugin: &str, name: &str, config: Value) -> (PathBuf, FilterSpec) {
    let config = (!config.is_null()).then_some(config);
    (
        guest(plugin),
        FilterSpec {
            name: Some(name.to_owned()),
            config,
            ..FilterSpec::default()
        },
    )
}

/// As [`spec`], in warm isolation.
pub fn warm(plugin: &str, name: &str, config: Value) -> (PathBuf, FilterSpec) {
    let (path, spec) = spec(plugin, name, config);
    (
        path,
        FilterSpec {
            isolation: Isolation::Warm,
            ..spec
        },
    )
}

/// Loads filters into `engine`, in order.
pub async fn load_in(engine: &Engine, specs: Vec<(PathBuf, FilterSpec)>) -> PluginSet {
    PluginSet::from_specs(engine, specs, &mut |_| {})
        .await
        .expect("the test filters load")
}

/// Loads filters into the shared engine, in order.
pub async fn load(specs: Vec<(PathBuf, FilterSpec)>) -> PluginSet {
    load_in(&engine(), specs).await
}

/// Streams a chat ("hi") through `filters` over a model that answers
/// `reply`; returns the answer's text and what the sink received.
pub async fn stream(
    filters: Vec<(PathBuf, FilterSpec)>,
    reply: Reply,
) -> (Result<String, ChainError>, Collector) {
    let plugins = load(filters).await;
    let kernel = shallot::Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![reply]))
        .build()
        .unwrap();
    let sink = Collector::default();
    let result = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .map(|r| r.text());
    (result, sink)
}

/// A one-message conversation.
pub fn ask(text: &str) -> ChatRequest {
    ChatRequest::new(vec![Message::user(text)])
}

/// The list stored under `key` in `context`, as strings.
pub fn strings(context: &Context, key: &str) -> Vec<String> {
    match context.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Appends `item` to the list under `key` (as the probe guest does).
pub fn push(context: &Context, key: &str, item: &str) {
    let mut list = match context.get(key) {
        Some(Value::Array(items)) => items,
        _ => Vec::new(),
    };
    list.push(Value::from(item));
    context.set(key, Value::Array(list));
}

/// One model reply of a script.
#[derive(Clone, Debug)]
pub enum Reply {
    /// Answers with this text (streamed as one token).
    Text(String),
    /// Streams these tokens (text, meta); the answer is their text joined.
    Tokens(Vec<(String, Option<String>)>),
    /// Fails with this error.
    Fail(ChainError),
    /// Streams these tokens, then the connection breaks.
    BreakAfter(Vec<String>, ChainError),
    /// Answers with the text after a pause.
    Slow(Duration, String),
    /// Streams these tokens with a pause before each, so each arrives as
    /// its own batch, as from a real model.
    Paced(Vec<String>, Duration),
    /// Asks for these tool calls (name, arguments), with no text.
    Calls(Vec<(String, Value)>),
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

    /// The requests it received, in order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.state.requests.lock().unwrap().clone()
    }

    fn next(&self, request: &ChatRequest, context: &Context) -> (usize, Reply) {
        let n = self.state.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.requests.lock().unwrap().push(request.clone());
        if self.state.trace {
            push(context, "trace", "terminal");
        }
        (n, (self.state.script)(n, request))
    }
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
            Reply::BreakAfter(tokens, error) => stream::iter(
                tokens
                    .into_iter()
                    .map(|t| token((t, None)))
                    .chain([Err(error)]),
            )
            .boxed(),
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
        })
    }
}

/// A token's text and metadata.
type OwnedToken = (String, Option<String>);

/// A token sink that records every delivery.
#[derive(Clone, Default)]
pub struct Collector {
    deliveries: Arc<Mutex<Vec<Vec<OwnedToken>>>>,
}

impl TokenSink for Collector {
    fn deliver(&self, tokens: &TokenBatch) {
        let batch = tokens
            .iter()
            .map(|t| (t.text.to_owned(), t.meta.map(str::to_owned)))
            .collect();
        self.deliveries.lock().unwrap().push(batch);
    }
}

impl Collector {
    /// Every token received, in order.
    pub fn tokens(&self) -> Vec<String> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Every token with its metadata.
    pub fn tokens_with_meta(&self) -> Vec<(String, Option<String>)> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The tokens of each delivery, in order.
    pub fn deliveries(&self) -> Vec<Vec<String>> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.iter().map(|(t, _)| t.clone()).collect())
            .collect()
    }

    /// All text received.
    pub fn text(&self) -> String {
        self.tokens().concat()
    }
}

/// A kernel of `plugins` over a model that always answers `answer`.
pub fn answering(plugins: &PluginSet, answer: &str) -> shallot::Kernel {
    shallot::Kernel::builder()
        .plugins(plugins)
        .model(ScriptedModel::answer(answer))
        .build()
        .expect("the kernel builds")
}

/// Runs one chat ("hi") through `kernel` and returns the invoke's context.
pub async fn chat_context(kernel: &shallot::Kernel) -> Context {
    let context = Context::new();
    kernel
        .chat(ask("hi"), context.clone())
        .await
        .expect("the chat succeeds");
    context
}

/// What the fake provider answers one request with.
#[derive(Clone, Debug)]
pub enum Canned {
    /// A JSON body with this status and extra headers.
    Json(u16, Value, Vec<(&'static str, String)>),
    /// A server-sent-event stream of these `data:` payloads, then `[DONE]`
    /// if `done`, then the connection closes.
    Sse(Vec<Value>, bool),
    /// Starts a stream with these `data:` payloads, then falls silent.
    Stall(Vec<Value>),
    /// Never answers.
    Hang,
    /// Closes the connection without answering.
    Close,
}

/// A local server that speaks enough HTTP/1.1 and chat-completions to play
/// a model provider: each request gets the next canned answer (the last
/// repeats), and every request body is recorded.
pub struct FakeProvider {
    /// The API base to point a client at.
    pub url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl FakeProvider {
    /// Starts serving on a loopback port.
    pub async fn start(script: Vec<Canned>) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = bodies.clone();
        tokio::spawn(async move {
            let mut served = 0usize;
            while let Ok((mut socket, _)) = listener.accept().await {
                let canned = script
                    .get(served)
                    .or(script.last())
                    .cloned()
                    .expect("a script");
                served += 1;
                let recorded = recorded.clone();
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 4096];
                    let body_start = loop {
                        let n = socket.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        request.extend_from_slice(&buf[..n]);
                        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                    };
                    let head = String::from_utf8_lossy(&request[..body_start]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while request.len() < body_start + length {
                        let n = socket.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        request.extend_from_slice(&buf[..n]);
                    }
                    let body = serde_json::from_slice(&request[body_start..body_start + length])
                        .unwrap_or(Value::Null);
                    recorded.lock().unwrap().push(body);
                    match canned {
                        Canned::Json(status, body, headers) => {
                            let body = body.to_string();
                            let extra: String = headers
                                .iter()
                                .map(|(k, v)| format!("{k}: {v}\r\n"))
                                .collect();
                            let response = format!(
                                "HTTP/1.1 {status} Canned\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
                                body.len()
                            );
                            let _ = socket.write_all(response.as_bytes()).await;
                        }
                        Canned::Sse(chunks, done) => {
                            send_events(&mut socket, chunks).await;
                            if done {
                                let _ = socket.write_all(b"data: [DONE]\n\n").await;
                            }
                        }
                        Canned::Stall(chunks) => {
                            send_events(&mut socket, chunks).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                        Canned::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
                        Canned::Close => {}
                    }
                    let _ = socket.shutdown().await;
                });
            }
        });
        FakeProvider { url, bodies }
    }

    /// The request bodies received, in order.
    pub fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// Answers with an event-stream head and `chunks` as `data:` events.
async fn send_events(socket: &mut tokio::net::TcpStream, chunks: Vec<Value>) {
    use tokio::io::AsyncWriteExt;
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let _ = socket.write_all(head.as_bytes()).await;
    for chunk in chunks {
        let _ = socket
            .write_all(format!("data: {chunk}\n\n").as_bytes())
            .await;
        let _ = socket.flush().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
