//! Hostile filters: one test per way a filter has tried to get past the
//! sandbox (budgets through `next`, host memory, the shared context, model
//! output, stderr across invokes, sleeping, starvation, deadlock, compile
//! bombs, floods of `next`, hostile error text, impersonation). Each asserts containment:
//! a typed error naming the filter, its plugin file and the call; the same
//! kernel serving innocent requests afterwards; host memory bounded.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use serde_json::json;
use shallot::types::{
    ChatRequest, ChatResponse, FinishReason, Message, ToolCall, ToolSpec, TurnRequest, TurnResult,
};
use shallot::{
    ApprovalRequest, ChainError, ChatModel, Context, Engine, EngineConfig, ErrorKind, FilterSet,
    FilterSpec, Grants, Kernel, Limits, LoadError, LoopConfig, MemoryHistory, ModelEvent, ToolLoop,
};
use shallot_tests::{
    Collector, RedisServer, Reply, ScriptedModel, WebService, ask, granted, lines, load, load_in,
    resident_mib, spec, trace_file, trace_grant, warm,
};

fn hostile(on: &str, action: &str, limits: Limits) -> (PathBuf, FilterSpec) {
    let (path, mut spec) = spec(
        "misbehave",
        "bad",
        json!({ "on": on, "do": action, "when": "boom" }),
    );
    spec.limits = limits;
    (path, spec)
}

fn kernel(plugins: &FilterSet, model: impl ChatModel) -> Kernel {
    Kernel::builder()
        .plugins(plugins)
        .model(model)
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap()
}

fn assert_contained(error: &ChainError, kind: ErrorKind, call: &str, says: &str) {
    assert_eq!(error.kind, kind, "{error}");
    let origin = error.origin.as_ref().expect("the error names its filter");
    assert_eq!(&*origin.filter, "bad", "{error}");
    assert_eq!(origin.call, call, "{error}");
    assert!(
        origin.plugin.as_ref().unwrap().ends_with("misbehave.wasm"),
        "{error}"
    );
    assert!(error.message.contains(says), "{error}");
}

/// Default limits with time enough for a flood to reach the cap under test
/// (the debug host copies megabytes slowly, and tests run side by side):
/// the cap a test is about must trip, not the clock.
fn generous() -> Limits {
    Limits {
        cpu_ms: 10_000,
        wall_ms: 20_000,
        ..Limits::default()
    }
}

/// [`generous`] limits with a host memory cap of `mib`.
fn host_capped(mib: u32) -> Limits {
    Limits {
        host_mib: mib,
        ..generous()
    }
}

/// A kernel over filter `bad` doing `action` in around-chat, and the error
/// of the request that sets it off.
async fn strike(action: &str, limits: Limits) -> (Kernel, ChainError) {
    let plugins = load(vec![hostile("chat", action, limits)]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    (kernel, error)
}

async fn innocent_chat_works(kernel: &Kernel) {
    let response = kernel.chat(ask("hello"), Context::new()).await.unwrap();
    assert!(!response.text().is_empty());
}

#[tokio::test]
async fn the_cpu_budget_counts_own_work_between_calls_to_next() {
    let limits = Limits {
        next_calls: 1000,
        ..Limits::default()
    };
    let (kernel, error) = strike("next-and-work", limits).await;
    assert_contained(
        &error,
        ErrorKind::PluginFault,
        "around-chat",
        "exceeded its CPU budget of 100 ms",
    );
    innocent_chat_works(&kernel).await;
}

/// Runs `action` (which makes the host hold more and more) three times
/// under a 16 MiB host memory cap: each run faults, and host memory stays
/// bounded.
async fn host_memory_is_capped(action: &str, next_calls: u32, model: ScriptedModel) {
    let limits = Limits {
        host_mib: 16,
        next_calls,
        ..generous()
    };
    let plugins = load(vec![hostile("chat", action, limits)]).await;
    let kernel = kernel(&plugins, model);
    let (before, _) = resident_mib();
    for _ in 0..3 {
        let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
        assert_contained(
            &error,
            ErrorKind::PluginFault,
            "around-chat",
            "exceeded its host memory cap of 16 MiB",
        );
    }
    assert!(resident_mib().0 < before + 512, "host memory stays bounded");
    innocent_chat_works(&kernel).await;
}

#[tokio::test]
async fn host_memory_a_filter_creates_is_charged_to_it() {
    host_memory_is_capped("host-alloc", 16, ScriptedModel::answer("fine")).await;
}

#[tokio::test]
async fn responses_next_hands_back_are_charged_to_the_filter_that_keeps_them() {
    let big = "z".repeat(1 << 20);
    host_memory_is_capped("hoard-next", 2000, ScriptedModel::answer(&big)).await;
}

#[tokio::test]
async fn the_handles_a_filter_holds_are_capped() {
    let limits = generous();
    let (kernel, error) = strike("hoard-handles", limits).await;
    assert_contained(
        &error,
        ErrorKind::PluginFault,
        "around-chat",
        "held more than 65536 handles",
    );
    innocent_chat_works(&kernel).await;
}

#[tokio::test]
async fn the_shared_context_is_bounded_and_a_faulted_calls_writes_are_undone() {
    let limits = host_capped(8);
    let plugins = load(vec![hostile("chat", "flood-context", limits)]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let context = Context::new().with("tenant", "a");
    let error = kernel.chat(ask("boom"), context.clone()).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::PluginFault,
        "around-chat",
        "exceeded its host memory cap of 8 MiB",
    );
    assert_eq!(context.keys(), ["tenant"], "the flood was rolled back");
    innocent_chat_works(&kernel).await;
}

#[tokio::test]
async fn a_filter_that_traps_loses_its_context_writes() {
    let plugins = load(vec![hostile("chat", "write-then-trap", Limits::default())]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let context = Context::new();
    let error = kernel.chat(ask("boom"), context.clone()).await.unwrap_err();
    assert_contained(&error, ErrorKind::PluginFault, "around-chat", "trapped");
    assert_eq!(context.get("written"), None);
}

/// A faulted call's writes are undone with their charges: a value put
/// back is paid for again by the filter that had written it. (Undone
/// without its charge, a value written, then overwritten small by a call
/// that traps, stayed in the context for free, and the filter could write
/// past its host memory cap, one such pair at a time.)
#[tokio::test]
async fn a_value_a_fault_puts_back_is_charged_to_its_writer_again() {
    let limits = host_capped(1);
    let (path, mut spec) = spec(
        "misbehave",
        "bad",
        json!({ "on": "tool", "do": "shrink-then-trap" }),
    );
    spec.limits = limits;
    let plugins = load(vec![(path, spec)]).await;
    let call = |key: &str, op: &str| Reply::call("echo", json!({ "key": key, "op": op }));
    let model = ScriptedModel::replies(vec![
        call("k1", "big"),
        call("k1", "shrink"),
        call("k2", "big"),
        Reply::tokens(&["done"]),
    ]);
    let context = Context::new();
    let request = shallot::types::TurnRequest::new(vec![Message::user("go")]);
    let result = kernel(&plugins, model).turn(request, context.clone()).await;
    let shallot::types::TurnResult::Done(done) = result else {
        panic!("the turn goes on past its failed calls: {result:?}")
    };
    let failed: Vec<bool> = done.tool_calls.iter().map(|r| r.error.is_some()).collect();
    assert_eq!(failed, [false, true, true], "{:?}", done.tool_calls);
    let error = done.tool_calls[2].error.as_ref().unwrap();
    assert!(
        error.message.contains("host memory cap of 1 MiB"),
        "{error}"
    );
    let k1 = context.get("k1").expect("k1 is put back");
    assert!(k1.to_string().len() > 600 << 10);
    assert_eq!(context.get("k2"), None);
}

/// Each call of a concurrent tool batch keeps its own FCtx write until the
/// batch ends: each is charged, so a filter cannot hold its host memory cap
/// once per call of the batch.
#[tokio::test]
async fn fctx_writes_of_a_concurrent_batch_are_each_charged() {
    let (path, mut spec) = spec(
        "misbehave",
        "bad",
        json!({ "on": "tool", "do": "hoard-fctx" }),
    );
    spec.limits = host_capped(1);
    let plugins = load(vec![(path, spec)]).await;
    let model = ScriptedModel::replies(vec![
        Reply::Calls((0..4).map(|i| ("echo".into(), json!({ "i": i }))).collect()),
        Reply::tokens(&["done"]),
    ]);
    let request = shallot::types::TurnRequest::new(vec![Message::user("go")]);
    let result = kernel(&plugins, model).turn(request, Context::new()).await;
    let shallot::types::TurnResult::Done(done) = result else {
        panic!("the turn goes on past its failed calls: {result:?}")
    };
    let failed: Vec<&ChainError> = done
        .tool_calls
        .iter()
        .filter_map(|r| r.error.as_ref())
        .collect();
    assert_eq!(failed.len(), 2, "two of 400 KiB fit in 1 MiB: {failed:?}");
    for error in failed {
        assert!(
            error.message.contains("host memory cap of 1 MiB"),
            "{error}"
        );
    }
}

#[tokio::test]
async fn next_is_bounded_per_hook_call() {
    let plugins = load(vec![hostile("chat", "flood-next", Limits::default())]).await;
    let model = ScriptedModel::answer("fine");
    let kernel = kernel(&plugins, model.clone());
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::LimitExceeded,
        "around-chat",
        "called next more than 16 times",
    );
    assert_eq!(
        model.calls(),
        16,
        "the model was called no more than allowed"
    );
}

#[tokio::test]
async fn a_log_flood_does_not_stop_the_request() {
    let plugins = load(vec![hostile("chat", "flood-log", generous())]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let response = kernel.chat(ask("boom"), Context::new()).await.unwrap();
    assert_eq!(response.text(), "fine");
}

#[tokio::test]
async fn hostile_error_text_is_escaped_and_capped() {
    let (_, error) = strike("evil-error", Limits::default()).await;
    let shown = error.to_string();
    let line_breaks = ['\u{85}', '\u{2028}', '\u{2029}', '\u{9b}', '\u{200b}'];
    for bad in ['\u{1b}', '\0', '\u{202e}'].into_iter().chain(line_breaks) {
        assert!(!shown.contains(bad), "{shown:?}");
    }
    assert!(shown.contains("evil\\u{1b}[2J"), "{shown}");
    assert!(shown.len() < 4096, "{} bytes", shown.len());
}

/// A model whose one answer asks for a million tool calls.
struct Flooding;

#[async_trait]
impl ChatModel for Flooding {
    fn name(&self) -> &str {
        "flooding"
    }

    async fn chat(&self, _: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        let calls = (0..1_000_000)
            .map(|i| ToolCall {
                id: format!("c{i}"),
                name: "echo".to_owned(),
                arguments: "{}".to_owned(),
            })
            .collect();
        let message = Message {
            tool_calls: calls,
            ..Message::assistant("")
        };
        Ok(ChatResponse::new(message, FinishReason::ToolUse))
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let done = self.chat(request, context).await?;
        Ok(Box::pin(futures::stream::iter([Ok(ModelEvent::Done(
            done,
        ))])))
    }
}

/// The error a turn asking "go" of `kernel` ends with.
async fn failed_turn(kernel: &Kernel) -> ChainError {
    let request = shallot::types::TurnRequest::new(vec![Message::user("go")]);
    match kernel.turn(request, Context::new()).await {
        shallot::types::TurnResult::Error(error) => error,
        other => panic!("the turn fails: {other:?}"),
    }
}

#[tokio::test]
async fn a_model_answer_with_too_many_tool_calls_is_a_typed_error_from_the_model() {
    let kernel = Kernel::builder()
        .model(Flooding)
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap();
    let error = failed_turn(&kernel).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    let origin = error.origin.expect("the error names the model");
    assert_eq!(&*origin.filter, "model");
    assert!(
        error.message.contains("more than 128 tool calls"),
        "{}",
        error.message
    );
}

/// An Anthropic upstream whose streamed tool input never ends (each event
/// small, under the line cap) is cut at the bound on a whole answer:
/// the client does not keep what the server sends without end.
#[tokio::test]
async fn an_anthropic_stream_whose_tool_input_never_ends_is_cut_at_the_answer_bound() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = sent.clone();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = [0; 4096];
        let _ = socket.read(&mut head).await;
        let start = concat!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"usage\":{}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,",
            "\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{}}}\n\n",
        );
        socket.write_all(start.as_bytes()).await.unwrap();
        let piece = "x".repeat(60_000);
        let delta = format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"input_json_delta\",\"partial_json\":\"{piece}\"}}}}\n\n"
        );
        // Past four times the bound the server gives up and closes: a
        // client without the bound sees a stream that ended, not a limit.
        while counted.load(std::sync::atomic::Ordering::Relaxed) < 64 << 20
            && socket.write_all(delta.as_bytes()).await.is_ok()
        {
            counted.fetch_add(piece.len(), std::sync::atomic::Ordering::Relaxed);
        }
    });
    let model = shallot::AnthropicModel::new(shallot::AnthropicConfig::new(url, "m")).unwrap();
    let request = ChatRequest::new(vec![Message::user("go")]);
    let mut events = model.stream(&request, &Context::new()).await.unwrap();
    let error = loop {
        match futures::StreamExt::next(&mut events).await {
            Some(Ok(_)) => continue,
            Some(Err(error)) => break error,
            None => panic!("the stream ends with an error"),
        }
    };
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(
        error.message.contains("larger than 16777216 bytes"),
        "{error}"
    );
    // The stream that failed let go of its connection, though its
    // consumer still holds it: the server's writes fail and it ends.
    server.await.unwrap();
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        sent < 32 << 20,
        "the client stopped reading: {sent} bytes sent"
    );
    drop(events);
}

/// A filter that answers in the model's place is bounded as the model is:
/// its 10,000 made-up calls of a tool never run (each would copy the
/// tool's spec and run at once, past every limit on a model's answer).
#[tokio::test]
async fn tool_calls_a_filter_makes_up_are_bounded_like_the_models() {
    let (path, mut spec) = spec(
        "misbehave",
        "liar",
        json!({ "on": "chat", "do": "fake-calls" }),
    );
    // Making 10,000 calls takes a while in a debug build on a busy
    // machine; time is not what this bounds.
    spec.limits = generous();
    let plugins = load(vec![(path, spec)]).await;
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = ran.clone();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .tool(ToolSpec::new("echo", "", json!({})), move |args, _| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async move { Ok(args) }
        })
        .build()
        .unwrap();
    let error = failed_turn(&kernel).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(
        error.message.contains("more than 128 tool calls"),
        "{error}"
    );
    assert_eq!(ran.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[tokio::test]
async fn stderr_is_captured_per_call_and_never_reaches_another_invoke() {
    let (path, spec) = warm("misbehave", "bad", json!({ "on": "chat", "do": "print" }));
    let plugins = load(vec![(path, spec)]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    for i in 0..200 {
        let text = format!("tenant-a secret {i} {}", "-".repeat(100));
        kernel.chat(ask(&text), Context::new()).await.unwrap();
    }
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    let shown = error.to_string();
    assert!(shown.contains("misbehave saw: boom"), "{error}");
    assert!(!shown.contains("tenant-a"), "{error}");
}

/// Limits with a short own wall-clock bound, so sleeping tests end fast.
fn drowsy() -> Limits {
    Limits {
        wall_ms: 500,
        ..Limits::default()
    }
}

async fn sleeps_in(on: &str, call: &str) {
    let (path, mut spec) = spec("misbehave", "bad", json!({ "on": on, "do": "sleep" }));
    spec.limits = drowsy();
    let plugins = load(vec![(path, spec)]).await;
    let model = ScriptedModel::replies(vec![Reply::tokens(&["a", "b"])]);
    let kernel = kernel(&plugins, model);
    let error = match on {
        "tool" => kernel
            .tool("echo", json!({}), Context::new())
            .await
            .unwrap_err(),
        "turn" => match kernel
            .turn(
                shallot::types::TurnRequest::new(vec![Message::user("hi")]),
                Context::new(),
            )
            .await
        {
            shallot::types::TurnResult::Error(error) => error,
            other => panic!("the turn fails, not {other:?}"),
        },
        _ => kernel
            .chat_stream(ask("hi"), Context::new(), Collector::default())
            .await
            .unwrap_err(),
    };
    assert_contained(
        &error,
        ErrorKind::Timeout,
        call,
        "wall-clock bound of 500 ms",
    );
}

#[tokio::test]
async fn a_filter_that_sleeps_is_stopped_in_every_kind_of_call() {
    for (on, call) in [
        ("chat", "around-chat"),
        ("tool", "around-tool"),
        ("turn", "around-turn"),
        ("system-prompt", "system-prompt"),
        ("transformer", "token-transform"),
        ("step", "step"),
        ("flush", "flush"),
    ] {
        sleeps_in(on, call).await;
    }
}

#[tokio::test]
async fn a_destructor_that_sleeps_does_not_hang_the_stream() {
    let (path, mut spec) = spec("misbehave", "bad", json!({ "on": "drop", "do": "sleep" }));
    spec.limits = drowsy();
    let plugins = load(vec![(path, spec)]).await;
    let kernel = kernel(
        &plugins,
        ScriptedModel::replies(vec![Reply::tokens(&["a"])]),
    );
    let sink = Collector::default();
    kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(sink.tokens(), ["a"]);
}

#[tokio::test]
async fn the_own_wall_clock_bound_is_on_by_default() {
    let (kernel, error) = strike("sleep", Limits::default()).await;
    assert_contained(&error, ErrorKind::Timeout, "around-chat", "1000 ms");
    innocent_chat_works(&kernel).await;
}

#[tokio::test]
async fn a_configure_that_sleeps_fails_the_load() {
    let (path, mut spec) = spec(
        "misbehave",
        "bad",
        json!({ "on": "configure", "do": "sleep" }),
    );
    spec.limits = drowsy();
    let error = FilterSet::from_specs(&shallot_tests::engine(), vec![(path, spec)], &mut |_| {})
        .await
        .err()
        .expect("refused");
    let shown = error.to_string();
    assert!(shown.contains("configure"), "{shown}");
    assert!(shown.contains("wall-clock bound"), "{shown}");
}

/// An engine with very few slots and a short queue, for admission tests.
fn small_engine(slots: u32, queue: Duration) -> Engine {
    Engine::new(EngineConfig {
        instance_slots: slots,
        idle_instances: slots,
        prepared_instances: 1,
        cache_dir: Some(shallot_tests::target_dir().join("shallot-test-cache")),
        queue_timeout: queue,
        ..EngineConfig::default()
    })
    .unwrap()
}

type Chats = Vec<tokio::task::JoinHandle<Result<shallot::types::ChatResponse, ChainError>>>;

/// `count` chats started through a filter named `sleeper` that sleeps in
/// every around-chat, loaded into `engine` with `limits`, once `busy` of
/// them hold an instance.
async fn sleeping_chats(engine: &Engine, limits: Limits, count: usize, busy: usize) -> Chats {
    let (path, mut sleeper) = spec(
        "misbehave",
        "sleeper",
        json!({ "on": "chat", "do": "sleep" }),
    );
    sleeper.limits = limits;
    let plugins = load_in(engine, vec![(path, sleeper)]).await;
    let slow = kernel(&plugins, ScriptedModel::answer("late"));
    let chats = (0..count)
        .map(|_| {
            let slow = slow.clone();
            tokio::spawn(async move { slow.chat(ask("zzz"), Context::new()).await })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while plugins.filters()[0].stats().instances_in_use < busy {
        assert!(
            std::time::Instant::now() < deadline,
            "the sleepers never started"
        );
        tokio::task::yield_now().await;
    }
    chats
}

#[tokio::test]
async fn a_sleeping_filter_cannot_starve_requests_that_do_not_use_it() {
    let engine = small_engine(8, Duration::from_secs(30));
    let limits = Limits {
        instances: 3,
        wall_ms: 2000,
        ..Limits::default()
    };
    let sleepers = sleeping_chats(&engine, limits, 50, 3).await;
    let fast = load_in(&engine, vec![spec("probe", "innocent", json!({}))]).await;
    let fast = kernel(&fast, ScriptedModel::answer("fine"));
    for _ in 0..5 {
        assert_eq!(
            fast.chat(ask("hi"), Context::new()).await.unwrap().text(),
            "fine",
            "served while the sleeper holds its quota"
        );
    }
    for sleeper in sleepers {
        sleeper.abort();
    }
}

#[tokio::test]
async fn an_invoke_that_waits_too_long_for_instances_is_overloaded() {
    let engine = small_engine(3, Duration::from_millis(200));
    let limits = Limits {
        wall_ms: 3000,
        ..Limits::default()
    };
    let mut overloaded = 0;
    for call in sleeping_chats(&engine, limits, 6, 3).await {
        if let Err(error) = call.await.unwrap()
            && error.kind == ErrorKind::Overloaded
        {
            overloaded += 1;
        }
    }
    assert!(overloaded >= 3, "{overloaded} of 6 were turned away");
}

/// Every combination of hooks, isolation and chain, with far more
/// concurrent invokes than instance slots: all finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_far_above_the_slot_count_never_deadlocks() {
    let engine = small_engine(6, Duration::from_secs(60));
    let hook_sets = [
        vec!["system-prompt"],
        vec!["chat"],
        vec!["chat", "system-prompt"],
        vec!["turn", "chat", "tool", "tokens", "system-prompt"],
        vec!["tool", "tokens"],
    ];
    for hooks in hook_sets {
        for isolation in ["invoke", "warm"] {
            let config = json!({ "hooks": hooks });
            let filter = if isolation == "warm" {
                warm("probe", "p", config)
            } else {
                spec("probe", "p", config)
            };
            let plugins = load_in(&engine, vec![filter]).await;
            let model =
                ScriptedModel::replies(vec![Reply::Slow(Duration::from_millis(20), "ok".into())]);
            let kernel = Kernel::builder()
                .plugins(&plugins)
                .model(model)
                .builtin_tools()
                .build()
                .unwrap();
            let kernel = Arc::new(kernel);
            let calls: Vec<_> = (0..120)
                .map(|i| {
                    let kernel = kernel.clone();
                    tokio::spawn(async move {
                        match i % 4 {
                            0 => kernel.chat(ask("hi"), Context::new()).await.map(|_| ()),
                            1 => kernel
                                .chat_stream(ask("hi"), Context::new(), Collector::default())
                                .await
                                .map(|_| ()),
                            2 => kernel
                                .tool("echo", json!({"text": "x"}), Context::new())
                                .await
                                .map(|_| ()),
                            _ => match kernel
                                .turn(
                                    shallot::types::TurnRequest::new(vec![Message::user("hi")]),
                                    Context::new(),
                                )
                                .await
                            {
                                shallot::types::TurnResult::Error(e) => Err(e),
                                _ => Ok(()),
                            },
                        }
                    })
                })
                .collect();
            for call in calls {
                call.await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{hooks:?} {isolation}: {e}"));
            }
        }
    }
}

/// A component holding one core module with `functions` functions whose
/// bodies are `body`.
fn component(functions: usize, body: &[u8]) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    fn section(id: u8, content: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        leb(content.len(), out);
        out.extend_from_slice(content);
    }
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    section(1, &[1, 0x60, 0, 0], &mut module);
    let mut funcs = Vec::new();
    leb(functions, &mut funcs);
    funcs.extend(std::iter::repeat_n(0u8, functions));
    section(3, &funcs, &mut module);
    let mut code = Vec::new();
    leb(functions, &mut code);
    for _ in 0..functions {
        leb(body.len() + 1, &mut code);
        code.push(0);
        code.extend_from_slice(body);
    }
    section(10, &code, &mut module);
    let mut out = b"\0asm\x0d\0\x01\0".to_vec();
    section(1, &module, &mut out);
    out
}

fn refused(name: &str, bytes: Vec<u8>) -> String {
    let dir = std::env::temp_dir().join(format!("shallot-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let error: LoadError = shallot::compile_plugin(
        &Engine::new(EngineConfig {
            cache_dir: None,
            instance_slots: 1,
            idle_instances: 0,
            ..EngineConfig::default()
        })
        .unwrap(),
        &path,
        &std::fs::read(&path).unwrap(),
    )
    .err()
    .expect("refused");
    let shown = error.to_string();
    assert!(shown.contains(name), "names the file: {shown}");
    assert!(shown.contains("refused before compiling"), "{shown}");
    shown
}

#[test]
fn compile_bombs_are_refused_before_compiling() {
    let mut huge = vec![0x01; 1_100_000];
    huge.push(0x0b);
    assert!(refused("huge.wasm", component(1, &huge)).contains("bytes of code"));
    let mut nested = vec![];
    for _ in 0..2000 {
        nested.extend_from_slice(&[0x02, 0x40]);
    }
    nested.extend(std::iter::repeat_n(0x0b, 2001));
    assert!(refused("nested.wasm", component(1, &nested)).contains("nests blocks deeper"));
    assert!(
        refused("many.wasm", component(200_000, &[0x0b])).contains("more than 150000 functions")
    );
}

/// Compiles the probe guest with an engine whose compiles get `memory_mib`
/// and `timeout`.
fn compile_probe(memory_mib: u32, timeout: Duration) -> Result<(), LoadError> {
    let engine = Engine::new(EngineConfig {
        cache_dir: None,
        instance_slots: 1,
        idle_instances: 0,
        compile_memory_mib: memory_mib,
        compile_timeout: timeout,
        ..EngineConfig::default()
    })
    .unwrap();
    let path = shallot_tests::guest("probe");
    shallot::compile_plugin(&engine, &path, &std::fs::read(&path).unwrap()).map(|_| ())
}

#[test]
fn a_compile_runs_in_a_worker_bounded_in_memory_and_time() {
    compile_probe(4096, Duration::from_secs(120)).expect("compiles within the defaults");
    let error = compile_probe(64, Duration::from_secs(120)).unwrap_err();
    let shown = error.to_string();
    assert!(matches!(error, LoadError::CompileLimit { .. }), "{shown}");
    assert!(
        shown.contains("probe.wasm") && shown.contains("64 MiB"),
        "{shown}"
    );
    let error = compile_probe(4096, Duration::from_millis(1)).unwrap_err();
    assert!(
        error.to_string().contains("did not compile within"),
        "{error}"
    );
}

/// componentize-js's heap only grows (about a KiB a call) and its runtime
/// crashes when memory runs out during a collection; a warm instance is
/// replaced once it passes half its cap, so the filter runs on.
#[tokio::test]
async fn a_warm_javascript_filter_runs_on_past_its_memory_cap() {
    let (path, mut spec) = warm("js_probe", "js", json!({ "hooks": ["chat"] }));
    spec.limits.memory_mib = 32;
    let plugins = load(vec![(path, spec)]).await;
    let filter = plugins.filters()[0].clone();
    let kernel = Kernel::builder().plugins(&plugins).build().unwrap();
    for i in 0..20_000 {
        kernel
            .chat(ask("hi"), Context::new())
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
    }
    assert!(
        filter.guest_memory() <= 17 << 20,
        "{}",
        filter.guest_memory()
    );
}

/// A model (a terminal) that panics.
struct Broken;

#[async_trait]
impl ChatModel for Broken {
    fn name(&self) -> &str {
        "broken"
    }

    async fn chat(&self, _: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        panic!("the model's own bug")
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        panic!("the model's own bug")
    }
}

/// A native filter that passes everything through.
struct Around;

#[async_trait]
impl shallot::Filter for Around {
    fn name(&self) -> &str {
        "around"
    }
}

/// A terminal's panic is its own internal error, not the fault of the
/// native filter around it (nor a panic in the caller's task).
#[tokio::test]
async fn a_panicking_model_is_an_internal_error_of_the_model() {
    let kernel = Kernel::builder()
        .filter(Around)
        .model(Broken)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Internal, "{error}");
    assert_eq!(&*error.origin.as_ref().unwrap().filter, "model", "{error}");
    assert!(error.message.contains("the model's own bug"), "{error}");
}

/// The texts of every message the model was sent in its last call.
fn last_sent(model: &ScriptedModel) -> Vec<String> {
    let requests = model.requests();
    let last = requests.last().expect("the model was called");
    last.messages.iter().map(Message::text).collect()
}

/// A filter cannot change whom an invoke is for: pointing
/// `conversation_id` at another conversation (whose history the tool loop
/// loads and extends) is refused, and so is removing `tenant`; the turn
/// runs on in its own conversation.
#[tokio::test]
async fn a_filter_cannot_change_whom_an_invoke_is_for() {
    let plugins = load(vec![hostile("turn", "impersonate", Limits::default())]).await;
    let model = ScriptedModel::answer("fine");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .turn_terminal(ToolLoop::new(
            LoopConfig::default(),
            MemoryHistory::default(),
        ))
        .build()
        .unwrap();
    let turn = |text: &str| TurnRequest::new(vec![Message::user(text)]);
    let victim = || Context::new().with("conversation_id", "victim");
    let result = kernel.turn(turn("my secret is 42"), victim()).await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");

    let attacker = Context::new()
        .with("conversation_id", "attacker")
        .with("tenant", "acme");
    let result = kernel.turn(turn("boom"), attacker.clone()).await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    assert_eq!(attacker.get("conversation_id"), Some(json!("attacker")));
    assert_eq!(attacker.get("tenant"), Some(json!("acme")));
    assert_eq!(
        attacker.get(shallot::CANCELLED),
        None,
        "only the host says a turn was cancelled"
    );
    let sent = last_sent(&model);
    assert!(!sent.iter().any(|t| t.contains("secret")), "{sent:?}");

    let result = kernel.turn(turn("again"), victim()).await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    let sent = last_sent(&model);
    assert!(sent.iter().any(|t| t.contains("secret")), "{sent:?}");
    assert!(!sent.iter().any(|t| t.contains("boom")), "{sent:?}");
}

/// An inner filter's answer bigger than an outer filter's whole host
/// memory cap is an error the outer one gets from `next` (and here passes
/// on), not a fault blamed on it.
#[tokio::test]
async fn an_inner_answer_too_big_for_the_outer_filter_is_an_error_not_its_fault() {
    let (path, mut outer) = spec("passthrough", "outer", json!(null));
    outer.limits = host_capped(16);
    let inner = hostile("chat", "big-answer", generous());
    let plugins = load(vec![(path, outer), inner]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("does not fit"), "{error}");
    let origin = error
        .origin
        .as_ref()
        .expect("the error names the filter it is about");
    assert_eq!(
        (&*origin.filter, origin.call.as_str()),
        ("outer", "around-chat")
    );
    innocent_chat_works(&kernel).await;
}

/// A system prompt goes into every model call of the invoke: one bigger
/// than the filter's host memory cap is its fault, before any model call.
#[tokio::test]
async fn a_system_prompt_bigger_than_the_host_cap_is_a_fault() {
    let limits = host_capped(16);
    let plugins = load(vec![hostile("system-prompt", "huge-prompt", limits)]).await;
    let model = ScriptedModel::answer("fine");
    let kernel = kernel(&plugins, model.clone());
    let options = shallot::InvokeOptions::from(Context::new()).system_prompt("boom");
    let error = kernel.chat(ask("hi"), options).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::PluginFault,
        "system-prompt",
        "host memory cap",
    );
    assert_eq!(model.calls(), 0);
}

/// A batch cut off at its deadline keeps none of its calls' FCtx writes,
/// and gives back what they were charged: the next batch's writes fit.
#[tokio::test]
async fn a_batch_cut_at_its_deadline_gives_back_its_calls_fctx_charges() {
    let (path, mut spec) = spec(
        "misbehave",
        "bad",
        json!({ "on": "tool", "do": "hoard-fctx" }),
    );
    spec.limits = host_capped(1);
    let plugins = load(vec![(path, spec)]).await;
    let calls =
        |tool: &str| Reply::Calls((0..2).map(|i| (tool.into(), json!({ "i": i }))).collect());
    let model =
        ScriptedModel::replies(vec![calls("hang"), calls("echo"), Reply::tokens(&["done"])]);
    let config = LoopConfig {
        // Long enough for the second batch's ordinary calls on a busy
        // machine; the first never ends.
        batch_timeout: Some(Duration::from_secs(3)),
        ..LoopConfig::default()
    };
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .tool(ToolSpec::new("hang", "", json!({})), |_, _| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(json!("woke"))
        })
        .build()
        .unwrap();
    let result = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
        .await;
    let TurnResult::Done(done) = result else {
        panic!("the turn goes on past its cut batch: {result:?}")
    };
    let errors: Vec<Option<ErrorKind>> = done
        .tool_calls
        .iter()
        .map(|r| r.error.as_ref().map(|e| e.kind))
        .collect();
    assert_eq!(
        errors,
        [
            Some(ErrorKind::Timeout),
            Some(ErrorKind::Timeout),
            None,
            None
        ],
        "{:?}",
        done.tool_calls
    );
}

/// `action` of the misbehave guest in around-chat with `grants` and
/// generous limits, and the error it ends the chat with.
async fn abuse_granted(action: &str, grants: Grants) -> ChainError {
    let plugins = load(vec![granted(hostile("chat", action, generous()), grants)]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    kernel.chat(ask("boom"), Context::new()).await.unwrap_err()
}

fn store_grant(store: &str) -> Grants {
    Grants {
        memory: Some(store.into()),
        ..Grants::default()
    }
}

/// The store's encoding of a control character is six bytes: 11 MiB of
/// them from one call is 66 MiB as stored, past the 64 MiB per-call bound
/// however small it was as the guest wrote it. (Bounded as written, it
/// went through: 240 MiB stored under a 64 MiB bound.)
#[tokio::test]
async fn what_one_call_stores_is_bounded_as_the_store_keeps_it() {
    let error = abuse_granted("memory-swell", store_grant(":memory:swell")).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("as stored"), "{error}");
    let store = shallot::open_store(":memory:swell").await.unwrap();
    assert!(store.load("swollen", usize::MAX).await.unwrap().is_empty());
}

/// Size of `messages` as a store keeps them (JSON).
fn stored(messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| serde_json::to_string(m).unwrap().len())
        .sum()
}

/// One owner's conversations are one part of a store, under a sixteenth
/// of its cap, in every store: an owner that fills its part is refused
/// (the whole store was every tenant's), another owner, and the
/// conversations of no owner, go on; and behind client keys a filter keeps
/// its invoke's owner's conversations only.
#[tokio::test]
async fn one_owners_conversations_fill_their_own_part_of_every_store() {
    let redis = RedisServer::start();
    let megabyte = vec![Message::user("c".repeat(1 << 20))];
    for store in shallot_tests::every_store("conversation-parts", &redis) {
        let kept = shallot::open_store(store.as_str()).await.unwrap();
        let mut n = 0;
        let refused = loop {
            match kept.append(&format!("hog/c{n}"), &megabyte).await {
                Ok(()) if n < 100 => n += 1,
                Ok(()) => panic!("{store}: 100 MiB for one owner"),
                Err(e) => break e,
            }
        };
        assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{store}: {refused}");
        assert!(
            refused.message.contains("for this owner"),
            "{store}: {refused}"
        );
        for other in ["quiet/c0", "no-owner"] {
            kept.append(other, &megabyte)
                .await
                .unwrap_or_else(|e| panic!("{store}: {other} was refused: {e}"));
        }
        kept.clear("hog/c0").await.unwrap();
        kept.append("hog/again", &megabyte)
            .await
            .unwrap_or_else(|e| panic!("{store}: clearing gave no room back: {e}"));
    }
    let grants = Grants {
        memory: Some(":memory:".into()),
        ..Grants::default()
    };
    let plugins = load(vec![granted(
        hostile("chat", "memory-elsewhere", generous()),
        grants,
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let acme = Context::new().with(shallot::TENANT, "acme");
    let error = kernel.chat(ask("boom"), acme).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::InvalidRequest,
        "around-chat",
        "another owner",
    );
    kernel
        .chat(ask("boom"), Context::new())
        .await
        .expect("an invoke of no owner keeps any conversation");
}

/// A conversation keeps its latest 16 MiB as stored, in every store: three
/// calls of 12 MiB each leave the last one. (Unbounded, twenty invokes
/// left 1.3 GiB in the in-process store, read back whole on every load.)
#[tokio::test]
async fn a_conversation_keeps_its_latest_bytes_in_every_store() {
    let redis = RedisServer::start();
    let dir = shallot_tests::target_dir().join("test-scratch");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("hostile-swelling.db");
    let _ = std::fs::remove_file(&file);
    for store in [
        ":memory:swelling".to_owned(),
        file.display().to_string(),
        redis.url(),
    ] {
        let plugins = load(vec![granted(
            hostile("chat", "memory-escapes", generous()),
            store_grant(&store),
        )])
        .await;
        let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
        for _ in 0..3 {
            kernel.chat(ask("boom-grow"), Context::new()).await.unwrap();
        }
        let kept = shallot::open_store(store.as_str())
            .await
            .unwrap()
            .load("boom-grow", usize::MAX)
            .await
            .unwrap();
        assert_eq!(kept.len(), 1, "{store}: the oldest went");
        assert!(
            stored(&kept) <= shallot::CONVERSATION_CAP,
            "{store}: {} bytes",
            stored(&kept)
        );
    }
}

/// The in-process store is the host's memory: past its cap an append is
/// refused, whichever conversations it goes to.
#[tokio::test]
async fn the_in_process_store_is_bounded_across_conversations() {
    let plugins = load(vec![granted(
        hostile("chat", "memory-escapes", generous()),
        store_grant(":memory:filling"),
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let fit = shallot::IN_PROCESS_CAP / (12 << 20);
    for i in 0..fit {
        let asked = kernel.chat(ask(&format!("boom-{i}")), Context::new()).await;
        asked.unwrap_or_else(|e| panic!("append {i} of {fit} fits: {e}"));
    }
    let error = kernel
        .chat(ask("boom-over"), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("is full"), "{error}");
    let store = shallot::open_store(":memory:filling").await.unwrap();
    for i in 0..fit {
        store.clear(&format!("boom-{i}")).await.unwrap();
    }
    kernel
        .chat(ask("boom-again"), Context::new())
        .await
        .unwrap();
}

/// A trace event's cap is on the line as written: 12,000 control
/// characters are 72,000 bytes escaped, over the 64 KiB cap. (Checked as
/// handed over, a 64,999-byte event became a 247,009-byte line.)
#[tokio::test]
async fn a_trace_event_is_capped_as_written() {
    let path = trace_file("escapes");
    let error = abuse_granted("trace-escapes", trace_grant(&path)).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("over the cap"), "{error}");
    assert!(lines(&path).is_empty());
}

/// What the guest's `FORGED` text is.
const FORGED: &str =
    "ok\u{85}{\"filter\":\"approval\",\"approved\":true}\u{2028}x\u{2029}\u{9b}2J\u{202e}\u{200b}";

/// Characters that end a line for some reader, or command a terminal.
fn forges(text: &str) -> bool {
    text.chars().any(|c| {
        c.is_control() && c != '\n'
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202e}' | '\u{200b}')
    })
}

/// A trace line carries Unicode line breaks and C1 controls escaped: one
/// line for any reader, the same JSON for a parser.
#[tokio::test]
async fn a_trace_line_forges_no_lines() {
    let path = trace_file("forged-lines");
    let plugins = load(vec![granted(
        hostile("chat", "trace-forged", generous()),
        trace_grant(&path),
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    kernel.chat(ask("boom"), Context::new()).await.unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!forges(&text), "{text:?}");
    assert_eq!(text.lines().count(), 1);
    assert_eq!(lines(&path)[0]["said"], FORGED);
}

/// The approval handler (a person at a terminal, in `shallot chat`) gets
/// the tool and the reason with every line break and terminal command
/// escaped.
#[tokio::test]
async fn an_approval_question_reaches_the_handler_escaped() {
    let plugins = load(vec![granted(
        hostile("chat", "ask-forged", generous()),
        Grants {
            approval: true,
            ..Grants::default()
        },
    )])
    .await;
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .approver(move |request: &ApprovalRequest| {
            let question = format!("{} {}", request.tool, request.reason);
            seen.lock().unwrap().push(question);
            false
        })
        .build()
        .unwrap();
    kernel.chat(ask("boom"), Context::new()).await.unwrap();
    let asked = asked.lock().unwrap();
    assert_eq!(asked.len(), 1);
    assert!(!forges(&asked[0]), "{:?}", asked[0]);
    assert!(asked[0].contains("safeguard: approved"), "{}", asked[0]);
}

/// A question's arguments are bounded before the host parses or holds
/// them (a 50 MB question made the host hold 164 MiB): 8 MiB is refused,
/// and nobody is asked.
#[tokio::test]
async fn an_approval_question_is_bounded_before_the_host_holds_it() {
    let plugins = load(vec![granted(
        hostile("chat", "ask-huge", generous()),
        Grants {
            approval: true,
            ..Grants::default()
        },
    )])
    .await;
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = asked.clone();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .approver(move |_: &ApprovalRequest| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            true
        })
        .build()
        .unwrap();
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("arguments"), "{error}");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// `sleep(0)` in a loop costs the host a wake-up each time and no grant:
/// each sleep counts a millisecond at least and a call sleeps 64 times at
/// most. (Unbounded, such a loop ran 30 s and 4.9 s of host CPU under a
/// 100 ms CPU budget and a 1 s wall bound.)
#[tokio::test]
async fn a_filter_cannot_spin_on_sleep() {
    let error = abuse_granted(
        "spin-sleep",
        Grants {
            sleep_ms: 30_000,
            ..Grants::default()
        },
    )
    .await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("64 sleeps"), "{error}");
}

/// A filter stopped by its own `timeout_ms` (a deadline that drops the
/// call, rather than a fault inside it) loses its writes to the shared
/// context too, and what the key held before comes back.
#[tokio::test]
async fn a_filter_that_times_out_loses_its_context_writes() {
    let limits = Limits {
        timeout_ms: 100,
        ..Limits::default()
    };
    let grants = Grants {
        sleep_ms: 10_000,
        ..Grants::default()
    };
    let plugins = load(vec![granted(
        hostile("chat", "write-then-nap", limits),
        grants,
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let context = Context::new().with("written", "before");
    let error = kernel.chat(ask("boom"), context.clone()).await.unwrap_err();
    assert_contained(&error, ErrorKind::Timeout, "around-chat", "did not finish");
    assert_eq!(context.get("written"), Some(json!("before")));
}

/// An outer filter told of an inner one's fault learns its name, its call
/// and what happened: not its plugin file, what it wrote to stderr or its
/// backtrace. The operator's error keeps those.
#[tokio::test]
async fn a_filter_learns_of_an_inner_fault_its_name_and_what_happened_only() {
    let outer = spec("misbehave", "outer", json!({ "on": "chat", "do": "mimic" }));
    let plugins = load(vec![outer, hostile("chat", "print", generous())]).await;
    let outer = kernel(&plugins, ScriptedModel::answer("fine"));
    let error = outer.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_eq!(&*error.origin.as_ref().unwrap().filter, "outer", "{error}");
    let told = &error.message;
    assert!(told.contains("filter 'bad' in around-chat"), "{told}");
    for internal in [".wasm", "it wrote", "misbehave saw", "backtrace"] {
        assert!(!told.contains(internal), "{internal}: {told}");
    }
    let direct = load(vec![hostile("chat", "print", generous())]).await;
    let direct = kernel(&direct, ScriptedModel::answer("fine"))
        .chat(ask("boom"), Context::new())
        .await;
    let operator = direct.unwrap_err().to_string();
    assert!(operator.contains("misbehave.wasm"), "{operator}");
    assert!(
        operator.contains("it wrote: misbehave saw: boom"),
        "{operator}"
    );
}

/// Each granted import works only in the calls it is for: none while the
/// instance is made and configured (one plugin set's instance creation
/// wrote 78 trace lines), no questions or store operations from a token
/// transformer. Refused with a typed error, and nothing happens.
#[tokio::test]
async fn granted_imports_are_refused_outside_the_calls_they_are_for() {
    let path = trace_file("configure");
    let all = Grants {
        sleep_ms: 1000,
        approval: true,
        trace: Some(path.to_path_buf().into()),
        memory: Some(":memory:misplaced".into()),
        ..Grants::default()
    };
    for (action, import) in [
        ("flood-trace", "trace.write"),
        ("nap", "timer.sleep"),
        ("memory-chatter", "memory"),
        ("ask", "approval.ask"),
    ] {
        let at_configure = spec(
            "misbehave",
            "bad",
            json!({ "on": "configure", "do": action }),
        );
        let filter = granted(at_configure, all.clone());
        let refused = FilterSet::from_specs(&shallot_tests::engine(), vec![filter], &mut |_| {})
            .await
            .err()
            .unwrap_or_else(|| panic!("{action} in configure is refused"))
            .to_string();
        assert!(
            refused.contains(&format!("{import} may be called only from")),
            "{action}: {refused}"
        );
    }
    assert!(lines(&path).is_empty(), "nothing was traced");
    for (action, import) in [("memory-chatter", "memory"), ("ask", "approval.ask")] {
        let (path, mut filter) = spec("misbehave", "bad", json!({ "on": "step", "do": action }));
        filter.grants = all.clone();
        let plugins = load(vec![(path, filter)]).await;
        let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
        let error = kernel
            .chat_stream(ask("hi"), Context::new(), Collector::default())
            .await
            .unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidRequest, "{action}: {error}");
        assert!(
            error
                .message
                .contains(&format!("{import} may be called only from")),
            "{action}: {error}"
        );
    }
}

fn kv_grant(store: &str) -> Grants {
    Grants {
        kv: Some(shallot::StoreSpec::from(store).into()),
        ..Grants::default()
    }
}

/// One namespace's fill is not everyone's outage: every store holds each
/// namespace to its own cap (16 MiB in the process, 64 MiB in an SQLite
/// file or a Redis server; the SQLite file's 1 GiB was every namespace's
/// at once), and another namespace writes on; a Redis past its own
/// `maxmemory` is `limit-exceeded`, not a failure worth retrying.
#[tokio::test]
async fn one_namespaces_fill_leaves_every_other_its_room_in_every_store() {
    let redis = RedisServer::start();
    let megabyte = "v".repeat(1 << 20);
    for store in shallot_tests::every_store("namespace-fill", &redis) {
        let kv = shallot::open_kv(store.as_str()).await.unwrap();
        let mut written = 0;
        let refused = loop {
            match kv
                .set("hog", None, &format!("k{written}"), &megabyte, None)
                .await
            {
                Ok(_) if written < 100 => written += 1,
                Ok(_) => panic!("{store}: 100 MiB in one namespace"),
                Err(e) => break e,
            }
        };
        assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{store}: {refused}");
        assert!(written >= 15, "{store}: refused after {written} MiB");
        kv.set("innocent", None, "k", &megabyte, None)
            .await
            .unwrap_or_else(|e| panic!("{store}: another namespace was refused: {e}"));
        for n in 0..written {
            kv.delete("hog", &format!("k{n}")).await.unwrap();
        }
        kv.set("hog", None, "again", &megabyte, None)
            .await
            .unwrap_or_else(|e| panic!("{store}: deleting gave no room back: {e}"));
    }
    let small =
        RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]);
    let kv = shallot::open_kv(small.url().as_str()).await.unwrap();
    let mut n = 0;
    let refused = loop {
        n += 1;
        assert!(n < 100, "a Redis of 4 MiB took {n} MiB");
        if let Err(e) = kv.set("any", None, &format!("k{n}"), &megabyte, None).await {
            break e;
        }
    };
    assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{refused}");
    assert!(refused.message.contains("maxmemory"), "{refused}");
}

/// One owner's fill of a shared namespace is not the other owners' outage:
/// in every store a key counts in its last writer's part, an eighth of the
/// namespace (2 MiB in the process, 8 MiB in an SQLite file or a Redis
/// server), so a tenant flooding a filter's namespace is refused there
/// while other tenants and unowned writes go on; rewriting another owner's
/// key counts in the writer's part (refused, that key kept, when it is
/// full); deleting gives room back.
#[tokio::test]
async fn one_owners_fill_of_a_shared_namespace_leaves_other_owners_room() {
    let redis = RedisServer::start();
    let quarter = "v".repeat(256 << 10);
    for store in shallot_tests::every_store("owner-fill", &redis) {
        let kv = shallot::open_kv(store.as_str()).await.unwrap();
        kv.set("shared", Some("quiet"), "theirs", "kept", None)
            .await
            .unwrap();
        let mut written = 0;
        let refused = loop {
            match kv
                .set(
                    "shared",
                    Some("hog"),
                    &format!("k{written}"),
                    &quarter,
                    None,
                )
                .await
            {
                Ok(_) if written < 100 => written += 1,
                Ok(_) => panic!("{store}: 25 MiB for one owner"),
                Err(e) => break e,
            }
        };
        assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{store}: {refused}");
        assert!(
            refused.message.contains("for this owner"),
            "{store}: {refused}"
        );
        assert!(
            (7..40).contains(&written),
            "{store}: refused after {written} writes"
        );
        let taken = kv
            .set("shared", Some("hog"), "theirs", &quarter, None)
            .await;
        assert!(
            taken.is_err(),
            "{store}: the hog grew past its part by another's key"
        );
        let theirs = kv.get("shared", "theirs").await.unwrap().unwrap();
        assert_eq!(theirs.value, "kept", "{store}");
        for (owner, key) in [(Some("quiet"), "q"), (None, "unowned")] {
            kv.set("shared", owner, key, &quarter, None)
                .await
                .unwrap_or_else(|e| panic!("{store}: {owner:?} was refused: {e}"));
        }
        kv.delete("shared", "k0").await.unwrap();
        kv.set("shared", Some("hog"), "again", &quarter, None)
            .await
            .unwrap_or_else(|e| panic!("{store}: deleting gave no room back: {e}"));
    }
    let mut hog = hostile("chat", "kv-flood", generous());
    hog.1.grants.kv = Some(shallot::StoreSpec::from(":memory:tenant-flood").into());
    let plugins = load(vec![hog]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let acme = Context::new().with(shallot::TENANT, "acme");
    let error = kernel.chat(ask("boom"), acme).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::LimitExceeded,
        "around-chat",
        "for this owner",
    );
    let store = shallot::open_kv(":memory:tenant-flood").await.unwrap();
    let megabyte = "v".repeat(1 << 20);
    store
        .set("bad", Some("other-tenant"), "k", &megabyte, None)
        .await
        .expect("another tenant writes on in the filter's namespace");
}

/// The CPU the host spends for a filter's call is the call's: writes to a
/// full in-process namespace of many keys are refused without a walk of
/// it, and what refusing them costs is charged to the filter's own CPU
/// (256 refused writes cost the host 580-670 ms, uncharged, each sweeping
/// the namespace under one lock for every namespace).
#[tokio::test]
async fn writes_to_a_full_namespace_cost_little_and_what_they_cost_is_the_filters() {
    let store = shallot::open_kv(":memory:overfull").await.unwrap();
    let mut n = 0;
    // The namespace of the filter `bad`.
    while store
        .set("bad", None, &format!("k{n}"), "", None)
        .await
        .is_ok()
    {
        n += 1;
    }
    assert!(n > 10_000, "{n} keys filled it");
    let mut hog = hostile("chat", "kv-overfull", generous());
    hog.1.grants.kv = Some(shallot::StoreSpec::from(":memory:overfull").into());
    let plugins = load(vec![hog]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let thread_cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    };
    let started = thread_cpu();
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    let spent = thread_cpu() - started;
    assert_contained(
        &error,
        ErrorKind::LimitExceeded,
        "around-chat",
        "more than 256 key-store operations",
    );
    let stats = plugins.filters()[0].stats();
    let own = stats
        .calls
        .iter()
        .find(|c| c.call == shallot::Call::AroundChat)
        .unwrap()
        .own_seconds;
    assert!(
        own >= spent.as_secs_f64() / 2.0,
        "the filter was charged {own:.4} s of the {:.4} s its call cost this thread",
        spent.as_secs_f64()
    );
}

/// Every abuse of `kv` fails the abuser's own call with a typed error, in
/// every store: floods, chatter and compare-and-set storms past the
/// per-call bounds, huge keys and values, counter overflow, a time to live
/// past a year, takes of too many windows, of none wide, of amounts past
/// 2^53 or until the operations run out, settles that would drive a
/// counter below zero or reach a window never taken, and keys spelled as
/// another namespace's, which reach nothing of it.
#[tokio::test]
async fn kv_abuses_are_contained_in_every_store() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("hostile-kv", &redis) {
        let victim = shallot::open_kv(store.as_str()).await.unwrap();
        victim
            .set("victim", None, "secret", "kept", None)
            .await
            .unwrap();
        for (action, kind, says) in [
            ("kv-flood", ErrorKind::LimitExceeded, ""),
            (
                "kv-chatter",
                ErrorKind::LimitExceeded,
                "256 key-store operations",
            ),
            (
                "kv-swap-storm",
                ErrorKind::LimitExceeded,
                "256 key-store operations",
            ),
            ("kv-huge-key", ErrorKind::InvalidRequest, "1 to 512 bytes"),
            ("kv-huge-value", ErrorKind::LimitExceeded, "over the cap"),
            ("kv-overflow", ErrorKind::InvalidRequest, "64-bit range"),
            ("kv-forever", ErrorKind::InvalidRequest, "a year"),
            ("kv-take-crowd", ErrorKind::InvalidRequest, "1 to 8 windows"),
            (
                "kv-take-instant",
                ErrorKind::InvalidRequest,
                "a window is 1 to",
            ),
            ("kv-take-huge", ErrorKind::InvalidRequest, "2^53"),
            (
                "kv-take-storm",
                ErrorKind::LimitExceeded,
                "256 key-store operations",
            ),
        ] {
            let plugins = load(vec![granted(
                hostile("chat", action, generous()),
                kv_grant(&store),
            )])
            .await;
            let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
            let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
            assert_contained(&error, kind, "around-chat", says);
            innocent_chat_works(&kernel).await;
        }
        for action in ["kv-trespass", "kv-settle-drain"] {
            let plugins = load(vec![granted(
                hostile("chat", action, generous()),
                kv_grant(&store),
            )])
            .await;
            let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
            let answer = kernel.chat(ask("boom"), Context::new()).await;
            assert!(answer.is_ok(), "{store} {action}: {answer:?}");
        }
        let kept = victim.get("victim", "secret").await.unwrap().unwrap();
        assert_eq!(kept.value, "kept", "{store}");
    }
}

/// A key store that goes away fails the call as `transient` within the
/// operation bound, and works again once it is back.
#[tokio::test]
async fn a_key_store_that_goes_away_is_a_transient_error_not_a_hang() {
    let mut redis = RedisServer::start();
    let plugins = load(vec![granted(
        hostile("chat", "kv-overflow", generous()),
        kv_grant(&redis.url()),
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    redis.stop();
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::Transient,
        "around-chat",
        "key store (Redis)",
    );
    redis.resume();
    // Known down, the store is asked again once a second: until then a
    // call fails at once, still `transient`.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let error = loop {
        let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
        if error.kind != ErrorKind::Transient || std::time::Instant::now() > deadline {
            break error;
        }
        assert!(error.message.contains("key store (Redis)"), "{error}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_contained(
        &error,
        ErrorKind::InvalidRequest,
        "around-chat",
        "64-bit range",
    );
}

/// The machine's own name, which resolves (through /etc/hosts) to a
/// loopback address: a name, not an address, that leads to a private one.
async fn a_name_for_loopback() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("the host name")
        .trim()
        .to_owned();
    let resolved: Vec<_> = tokio::net::lookup_host((name.as_str(), 80))
        .await
        .unwrap_or_else(|e| panic!("this test needs the host name {name} to resolve: {e}"))
        .collect();
    assert!(
        resolved.iter().all(|a| a.ip().is_loopback()),
        "this test needs the host name {name} to resolve to loopback, not {resolved:?}"
    );
    name
}

/// What a request's server reads of its origin is the checked origin: a
/// URL with a user and password (which reached the server in `Host`) is
/// refused before it leaves, `Host` is the origin's, and a `Host` the
/// filter writes is refused to it.
#[tokio::test]
async fn an_outgoing_requests_host_is_the_checked_origin_and_carries_no_credentials() {
    let service = WebService::start().await;
    let grant = shallot_tests::http_grant(&[&service.origin()]);
    let fetch = |config| shallot_tests::fetch(config, Some(grant.clone()), Limits::default());
    let with_user = service
        .url("/header?name=host")
        .replace("http://", "http://admin:hunter2@");
    let lines = fetch(json!({ "url": with_user })).await.unwrap();
    assert_eq!(lines, ["error HttpRequestUriInvalid"]);
    assert_eq!(service.hits(), 0, "nothing left the host");
    let origin = service.address.to_string();
    let host = service.url("/header?name=host");
    let lines = fetch(json!({ "url": host })).await.unwrap();
    assert_eq!(lines, [format!("200 {} {origin}", origin.len())]);
    let forged = json!({ "url": host, "header": ["host", "admin:hunter2@intranet"] });
    let lines = fetch(forged).await.unwrap();
    assert!(lines[0].contains("Forbidden"), "{lines:?}");
    assert_eq!(service.hits(), 1, "only the plain request reached it");
}

/// A filter's request says how far its invoke came, as a model call does
/// (`x-shallot-hops` one more), and no filter writes that or the tree's
/// loan: a gateway it reaches counts it as one more hop.
#[tokio::test]
async fn an_outgoing_request_says_its_hops_and_no_filter_forges_them() {
    let service = WebService::start().await;
    let grant = shallot_tests::http_grant(&[&service.origin()]);
    let fetch = |config| shallot_tests::fetch(config, Some(grant.clone()), Limits::default());
    let hops = service.url("/header?name=x-shallot-hops");
    let lines = fetch(json!({ "url": hops })).await.unwrap();
    assert_eq!(lines, ["200 1 1"]);
    for header in ["x-shallot-hops", "x-shallot-budget"] {
        let forged = json!({ "url": hops, "header": [header, "0"] });
        let lines = fetch(forged).await.unwrap();
        assert!(lines[0].contains("Forbidden"), "{header}: {lines:?}");
    }
}

/// Outgoing HTTP reaches only what the operator listed: nothing without
/// the grant, nothing at an unlisted origin (not even another port of a
/// listed host), nothing while the instance is configured, nothing at a
/// name that resolves to loopback (unless that origin is listed as
/// private), nothing through a redirect out of the list. Each refusal is
/// the filter's own typed error and never leaves the host.
#[tokio::test]
async fn http_reaches_only_the_listed_origins_and_no_private_address_through_a_name() {
    let service = WebService::start().await;
    let hello = service.url("/hello");
    let get = |url: &str| json!({ "url": url });
    let limits = Limits::default();
    let lines = shallot_tests::fetch(get(&hello), None, limits)
        .await
        .unwrap();
    assert_eq!(lines, ["error HttpRequestDenied"]);
    let other_port = format!("http://127.0.0.1:{}", service.address.port() + 1);
    let elsewhere = shallot_tests::http_grant(&[&other_port, "http://localhost:1"]);
    let lines = shallot_tests::fetch(get(&hello), Some(elsewhere), limits)
        .await
        .unwrap();
    assert_eq!(lines, ["error HttpRequestDenied"]);
    assert_eq!(service.hits(), 0, "a refused request never left the host");

    let grant = shallot_tests::http_grant(&[&service.origin()]);
    let (path, mut spec) = spec("fetch", "fetch", json!({ "url": hello, "on": "configure" }));
    spec.grants.http = Some(grant.clone());
    let error =
        shallot::FilterSet::from_specs(&shallot_tests::engine(), vec![(path, spec)], &mut |_| {})
            .await
            .err()
            .expect("the configure call fails");
    assert!(
        error.to_string().contains("error HttpRequestDenied"),
        "{error}"
    );
    assert_eq!(service.hits(), 0);

    let name = a_name_for_loopback().await;
    let by_name = format!("http://{name}:{}", service.address.port());
    let url = format!("{by_name}/hello");
    let lines = shallot_tests::fetch(
        get(&url),
        Some(shallot_tests::http_grant(&[&by_name])),
        limits,
    )
    .await
    .unwrap();
    assert_eq!(lines, ["error DestinationIpProhibited"]);
    assert_eq!(
        service.hits(),
        0,
        "the private address was never connected to"
    );
    let mut private = shallot_tests::http_grant(&[]);
    private.private = vec![shallot::HttpOrigin::try_from(by_name.clone()).unwrap()];
    let lines = shallot_tests::fetch(get(&url), Some(private), limits)
        .await
        .unwrap();
    assert_eq!(lines, ["200 22 hello from the service"]);

    let outside = WebService::start().await;
    let redirect = service.url(&format!("/redirect?to={}", outside.url("/hello")));
    let follow = json!({ "url": redirect, "follow": true });
    let lines = shallot_tests::fetch(follow, Some(grant), limits)
        .await
        .unwrap();
    assert_eq!(lines, ["302 0 ", "error HttpRequestDenied"]);
    assert_eq!(outside.hits(), 0, "the redirect's target was never reached");
}

/// A service that trickles, never answers, or sends gigabytes, and a
/// filter that sends too much or too often: each request ends within the
/// grant's bounds as the filter's own typed error, and the host holds
/// none of the flood.
#[tokio::test]
async fn http_to_a_hostile_service_is_bounded_in_time_bytes_and_requests() {
    let service = WebService::start().await;
    let mut grant = shallot_tests::http_grant(&[&service.origin()]);
    grant.receive_bytes = 1 << 20;
    grant.send_bytes = 64 << 10;
    grant.requests = 4;
    let limits = Limits {
        wall_ms: 5_000,
        ..Limits::default()
    };
    let fetch = |config| shallot_tests::fetch(config, Some(grant.clone()), limits);
    // A short time bound for the services that never answer, or trickle
    // (the others answer within the default five seconds).
    let mut hasty = grant.clone();
    hasty.timeout_ms = 400;
    let fetch_hastily = |config| shallot_tests::fetch(config, Some(hasty.clone()), limits);
    let lines = fetch_hastily(json!({ "url": service.url("/silent") }))
        .await
        .unwrap();
    assert_eq!(lines, ["error ConnectionReadTimeout"]);
    let lines = fetch_hastily(json!({ "url": service.url("/trickle?bytes=1000") }))
        .await
        .unwrap();
    assert_eq!(
        lines,
        ["error reading incoming body stream: HTTP response timeout"]
    );
    let (_, before) = resident_mib();
    let lines = fetch(json!({ "url": service.url("/flood") }))
        .await
        .unwrap();
    assert_eq!(lines.len(), 1);
    assert!(
        lines[0].starts_with(
            "error reading incoming body stream: HTTP response body size exceeds limit"
        ),
        "{lines:?}"
    );
    let (_, after) = resident_mib();
    assert!(
        after < before + 64,
        "the host held the flood: {before} MiB, then {after} MiB"
    );
    let lines = fetch(json!({ "url": service.url("/echo"), "body_bytes": 1 << 20 }))
        .await
        .unwrap();
    assert_eq!(lines.len(), 1);
    assert!(lines[0].starts_with("error "), "{lines:?}");
    assert!(
        service.received() <= 64 << 10,
        "{} bytes were sent",
        service.received()
    );
    let before = service.hits();
    let lines = fetch(json!({ "url": service.url("/hello"), "times": 6 }))
        .await
        .unwrap();
    let mut expected = vec!["200 22 hello from the service"; 4];
    expected.extend(["error ConnectionLimitReached"; 2]);
    assert_eq!(lines, expected);
    assert_eq!(service.hits() - before, 4);
}

/// A flood of model side calls stops at the grant's calls, or at its
/// tokens, whichever comes first, as the filter's own `limit-exceeded`;
/// each call's `max_tokens` is capped to the tokens left, however much it
/// asks; the side calls never go through the filters.
#[tokio::test]
async fn model_side_calls_are_bounded_in_calls_and_tokens_per_hook_call() {
    for (grant, calls, says) in [
        (
            shallot::ModelGrant::of("default"),
            4,
            "more than 4 model side calls",
        ),
        // Each call's prompt ("again") is about 6 tokens, its answer
        // ("fine") 1: two calls spend 14 of 20, and the third's prompt
        // does not fit in the 6 left.
        (
            shallot::ModelGrant {
                calls: 100,
                tokens: 20,
                ..shallot::ModelGrant::of("default")
            },
            2,
            "does not fit in the 6",
        ),
    ] {
        let mut bad = hostile("chat", "model-flood", generous());
        bad.1.grants.model = Some(grant);
        let plugins = load(vec![bad]).await;
        let model = ScriptedModel::answer("fine");
        let kernel = kernel(&plugins, model.clone());
        let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
        assert_contained(&error, ErrorKind::LimitExceeded, "around-chat", says);
        assert_eq!(model.calls(), calls);
        let asked = model.requests()[0].options.max_tokens.unwrap();
        assert!(asked <= 8192, "max_tokens capped: {asked}");
        innocent_chat_works(&kernel).await;
    }
}

/// A filter that floods its metrics keeps 64 series of a metric (the rest
/// counted in `other`, the total true) and 32 metrics; the 33rd is its own
/// `invalid-request`, and the kernel serves on.
#[tokio::test]
async fn a_metrics_flood_is_held_to_its_caps_with_true_totals() {
    let plugins = load(vec![hostile("chat", "metrics-flood", generous())]).await;
    let kernel = kernel(&plugins, ScriptedModel::answer("fine"));
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_contained(
        &error,
        ErrorKind::InvalidRequest,
        "around-chat",
        "at most 32 metrics",
    );
    innocent_chat_works(&kernel).await;
    let metrics = plugins.filters()[0].stats().metrics;
    assert_eq!(metrics.len(), 32);
    let floods = metrics.iter().find(|m| m.name == "floods").unwrap();
    assert_eq!(floods.series.len(), 64);
    let total: u64 = floods
        .series
        .iter()
        .map(|(_, value)| match value {
            shallot::MetricValue::Counter(n) => *n,
            shallot::MetricValue::Histogram { .. } => 0,
        })
        .sum();
    assert_eq!(total, 1000);
}
