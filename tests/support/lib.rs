//! What shallot's end-to-end tests and benchmarks share: where the built
//! guests are, one engine per process, a scriptable model (`model`), a
//! recording token sink (`sink`), a fake chat-completions server
//! (`provider`), a server of Anthropic's Messages wire (`anthropic`), a
//! real Redis server (`redis`) and a web service that answers well or
//! badly (`web`).

mod anthropic;
mod busy;
mod mcp;
mod model;
mod provider;
mod redis;
mod sink;
mod web;
mod wire;

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::Value;
use shallot::types::{ChatRequest, Message};
use shallot::{ChainError, Context, Engine, EngineConfig, FilterSet, Isolation};
use shallot::{FilterSpec, Grants};

pub use anthropic::AnthropicServer;
pub use busy::BusyCores;
pub use mcp::{McpHttpServer, mcp_python, mcp_script, mcp_test_server};
pub use model::{Reply, ScriptedModel};
pub use provider::{Canned, FakeProvider};
pub use redis::RedisServer;
pub use sink::Collector;
pub use web::WebService;

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

/// The stores a test of a granted store runs over, as a grant names them:
/// in-process (`:memory:<name>`), a fresh SQLite file (`<name>.db` in the
/// target directory's scratch space), and `redis`.
pub fn every_store(name: &str, redis: &RedisServer) -> Vec<String> {
    let dir = target_dir().join("test-scratch");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{name}.db"));
    let _ = std::fs::remove_file(&file);
    vec![
        format!(":memory:{name}"),
        file.display().to_string(),
        redis.url(),
    ]
}

/// What the `fetch` test guest's requests came to, one line each (`<status>
/// <bytes> <head of the body>` or `error <ErrorCode>`), configured with
/// `config`, granted `http`, under `limits`; or how its chat failed.
pub async fn fetch(
    config: Value,
    http: Option<shallot::HttpGrant>,
    limits: shallot::Limits,
) -> Result<Vec<String>, ChainError> {
    let (path, mut spec) = spec("fetch", "fetch", config);
    spec.limits = limits;
    spec.grants.http = http;
    let plugins = load(vec![(path, spec)]).await;
    let response = answering(&plugins, "the model")
        .chat(ask("go"), Context::new())
        .await?;
    Ok(response.text().lines().map(str::to_owned).collect())
}

/// An `http` grant of `origins` (texts), with the default bounds.
pub fn http_grant(origins: &[&str]) -> shallot::HttpGrant {
    shallot::HttpGrant::to(
        origins
            .iter()
            .map(|o| shallot::HttpOrigin::try_from(o.to_string()).expect("an origin")),
    )
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
            // Tests share it, two at a time on a machine that may be busy
            // with other work: an invoke waits for a place as long as it
            // must (the tests of the queue's bound make their own engines).
            let config = EngineConfig {
                cache_dir: Some(target_dir().join("shallot-test-cache")),
                queue_timeout: std::time::Duration::from_secs(600),
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
pub async fn load_in(engine: &Engine, specs: Vec<(PathBuf, FilterSpec)>) -> FilterSet {
    FilterSet::from_specs(engine, specs, &mut |_| {})
        .await
        .expect("the test filters load")
}

/// Loads filters into the shared engine, in order.
pub async fn load(specs: Vec<(PathBuf, FilterSpec)>) -> FilterSet {
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

/// A kernel of `plugins` over a model that always answers `answer`.
pub fn answering(plugins: &FilterSet, answer: &str) -> shallot::Kernel {
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

/// Asserts that `error` is not attributed to filter `filter`: the filter
/// passed an inner failure on, which kept its own origin.
pub fn assert_passed_on(error: &ChainError, filter: &str) {
    assert!(
        error.origin.as_ref().is_none_or(|o| &*o.filter != filter),
        "the inner failure, not {filter}'s own: {error} ({:?})",
        error.origin
    );
}

/// The process's resident memory now and at its peak (since it started,
/// or since `5` was written to `/proc/self/clear_refs`), in MiB.
pub fn resident_mib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            / 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Runs a turn whose message is "go" in a fresh context: the result, and
/// the context as the turn left it.
pub async fn turn_go(kernel: &shallot::Kernel) -> (shallot::types::TurnResult, Context) {
    let context = Context::new();
    let request = shallot::types::TurnRequest::new(vec![Message::user("go")]);
    (kernel.turn(request, context.clone()).await, context)
}

/// A filter spec with `grants`.
pub fn granted((path, spec): (PathBuf, FilterSpec), grants: Grants) -> (PathBuf, FilterSpec) {
    (path, FilterSpec { grants, ..spec })
}

/// A fresh trace file `name` under the target directory's scratch space.
pub fn trace_file(name: &str) -> PathBuf {
    let dir = target_dir().join("test-scratch").join("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.jsonl"));
    let _ = std::fs::remove_file(&path);
    path
}

/// Grants tracing to `path` (and the clock, so events carry real times).
pub fn trace_grant(path: &std::path::Path) -> Grants {
    Grants {
        trace: Some(path.to_path_buf().into()),
        clock: true,
        ..Grants::default()
    }
}

/// The JSON lines of a trace file.
pub fn lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).expect("each line is JSON"))
        .collect()
}
