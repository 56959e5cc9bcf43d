//! A broken or hostile filter fails its own request and nothing else:
//! traps, endless loops, memory bombs, deadlines, in every kind of hook.
//! After each, the same kernel serves the next request.

use serde_json::{Value, json};
use shallot::types::{FinishReason, ToolSpec};
use shallot::{Call, ChainError, Context, ErrorKind, Kernel, Limits};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, load, spec, strings};

/// A misbehave filter that strikes only when the text contains "boom".
fn misbehave(on: &str, action: &str) -> (std::path::PathBuf, shallot::FilterSpec) {
    spec(
        "misbehave",
        "bad",
        json!({ "on": on, "do": action, "when": "boom" }),
    )
}

fn kernel(plugins: &shallot::FilterSet) -> Kernel {
    Kernel::builder()
        .plugins(plugins)
        .model(ScriptedModel::answer("fine"))
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap()
}

fn assert_fault(error: &ChainError, call: &str, says: &str) {
    assert_eq!(error.kind, ErrorKind::PluginFault, "{error}");
    let origin = error.origin.as_ref().expect("a fault names its filter");
    assert_eq!(&*origin.filter, "bad");
    assert_eq!(origin.call, call);
    assert!(origin.plugin.as_ref().unwrap().ends_with("misbehave.wasm"));
    assert!(error.to_string().contains(says), "{error}");
}

async fn chat_fault(action: &str, says: &str) {
    let plugins = load(vec![misbehave("chat", action)]).await;
    let kernel = kernel(&plugins);
    let error = kernel.chat(ask("boom"), Context::new()).await.unwrap_err();
    assert_fault(&error, "around-chat", says);
    assert_eq!(
        kernel
            .chat(ask("hello"), Context::new())
            .await
            .unwrap()
            .text(),
        "fine",
        "the next request works"
    );
}

#[tokio::test]
async fn a_trap_in_a_hook_is_a_plugin_fault_and_the_next_request_works() {
    chat_fault("trap", "trapped").await;
}

#[tokio::test]
async fn a_panic_is_reported_with_the_guests_own_message() {
    chat_fault("panic", "misbehave: panic in chat").await;
    let plugins = load(vec![misbehave("chat", "panic")]).await;
    let error = kernel(&plugins)
        .chat(ask("boom"), Context::new())
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("it wrote: panicked at "),
        "{error}"
    );
    assert!(
        !error.message.contains("RUST_BACKTRACE"),
        "no advice a sandboxed filter cannot follow: {error}"
    );
}

#[tokio::test]
async fn an_endless_loop_in_a_hook_runs_out_of_cpu_budget() {
    chat_fault("loop", "exceeded its CPU budget of 100 ms").await;
}

#[tokio::test]
async fn a_memory_bomb_hits_the_memory_cap() {
    chat_fault("oom", "exceeded its memory cap of 64 MiB").await;
}

/// A kernel whose one filter burns `rounds` rounds of CPU in every chat
/// under a CPU budget of `cpu_ms`, and its filters (for their stats).
async fn spinning(rounds: u64, cpu_ms: u32) -> (Kernel, shallot::FilterSet) {
    let (path, mut spin) = spec(
        "misbehave",
        "spin",
        json!({ "on": "chat", "do": "spin", "rounds": rounds }),
    );
    spin.limits = Limits {
        cpu_ms,
        wall_ms: 60_000,
        ..Limits::default()
    };
    let plugins = load(vec![(path, spin)]).await;
    (kernel(&plugins), plugins)
}

/// The CPU a chat that burns `rounds` is charged, in milliseconds.
async fn charged(rounds: u64) -> f64 {
    let (kernel, plugins) = spinning(rounds, 60_000).await;
    kernel.chat(ask("spin"), Context::new()).await.unwrap();
    let stats = plugins.filters()[0].stats();
    let chat = stats.calls.iter().find(|c| c.call == Call::AroundChat);
    chat.expect("one chat").own_seconds * 1e3
}

/// A filter is charged the CPU it ran, not the time its core spent on
/// other work: with every core kept busy by other threads (a third of a
/// core left for each of the test's), a filter that runs about 60% of its
/// CPU budget passes and one that runs 150% of it fails, as on an idle
/// machine; a memory bomb still fails on its memory cap, not on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_is_charged_the_cpu_it_ran_not_the_time_the_host_was_busy() {
    // Rounds that cost about 40 ms of CPU on this machine, measured idle.
    let probe = 4_000_000;
    let rounds = (probe as f64 * 40.0 / charged(probe).await) as u64;
    let cost = charged(rounds).await;
    let near = (cost / 0.6).ceil() as u32;
    let over = (cost / 1.5).floor() as u32;
    for busy in [false, true] {
        let _busy = busy.then(shallot_tests::BusyCores::start);
        let (kernel, _) = spinning(rounds, near).await;
        for _ in 0..3 {
            let answer = kernel.chat(ask("spin"), Context::new()).await;
            assert!(
                answer.is_ok(),
                "{cost:.1} ms under a budget of {near} ms (busy: {busy}): {answer:?}"
            );
        }
        let (kernel, _) = spinning(rounds, over).await;
        let error = kernel.chat(ask("spin"), Context::new()).await.unwrap_err();
        let says = format!("exceeded its CPU budget of {over} ms");
        assert!(error.to_string().contains(&says), "busy: {busy}: {error}");
        chat_fault("oom", "exceeded its memory cap of 64 MiB").await;
    }
}

#[tokio::test]
async fn a_trap_in_a_tool_hook_fails_that_tool_call_only() {
    let plugins = load(vec![misbehave("tool", "trap")]).await;
    let kernel = kernel(&plugins);
    let error = kernel
        .tool("echo", json!({"x": "boom"}), Context::new())
        .await
        .unwrap_err();
    assert_fault(&error, "around-tool", "trapped");
    assert_eq!(
        kernel
            .tool("echo", json!({"x": 1}), Context::new())
            .await
            .unwrap()
            .output,
        r#"{"x":1}"#
    );
}

#[tokio::test]
async fn a_trap_in_an_inner_layer_reaches_the_outer_filter_as_an_error_value() {
    let catcher = spec("probe", "catcher", json!({ "tag": "c", "catch": true }));
    let plugins = load(vec![catcher, misbehave("chat", "trap")]).await;
    let context = Context::new();
    let response = kernel(&plugins)
        .chat(ask("boom"), context.clone())
        .await
        .unwrap();
    assert_eq!(response.finish_reason, FinishReason::Error);
    assert!(
        response.text().starts_with("caught: filter 'bad'"),
        "{}",
        response.text()
    );
    assert!(response.text().contains("trapped"), "{}", response.text());
    assert_eq!(
        strings(&context, "trace"),
        ["c_before", "c_after"],
        "the outer filter ran to its end"
    );
}

#[tokio::test]
async fn an_endless_loop_in_step_fails_the_stream() {
    let plugins = load(vec![misbehave("step", "loop")]).await;
    let model = ScriptedModel::replies(vec![Reply::tokens(&["boom"]), Reply::tokens(&["ok"])]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    let sink = Collector::default();
    let error = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap_err();
    assert_fault(&error, "step", "exceeded its CPU budget");
    assert!(sink.tokens().is_empty());
    let sink = Collector::default();
    kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(sink.tokens(), ["ok"]);
}

#[tokio::test]
async fn a_trap_in_flush_fails_the_stream_after_what_was_already_delivered() {
    let plugins = load(vec![spec(
        "misbehave",
        "bad",
        json!({ "on": "flush", "do": "trap" }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![Reply::tokens(&["a", "b"])]))
        .build()
        .unwrap();
    let sink = Collector::default();
    let error = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap_err();
    assert_fault(&error, "flush", "trapped");
    assert_eq!(sink.tokens(), ["a", "b"]);
}

#[tokio::test]
async fn a_configure_that_loops_fails_the_load_not_the_host() {
    let specs = vec![spec(
        "misbehave",
        "bad",
        json!({ "on": "configure", "do": "loop" }),
    )];
    let error = shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
        .await
        .err()
        .expect("refused");
    assert!(
        error.to_string().contains("exceeded its CPU budget"),
        "{error}"
    );
    assert!(error.to_string().contains("configure"), "{error}");
}

#[tokio::test]
async fn a_hook_past_its_wall_clock_bound_times_out() {
    let (path, mut bounded) = spec("probe", "bounded", json!({ "tag": "b" }));
    bounded.limits = Limits {
        timeout_ms: 2_000,
        ..Limits::default()
    };
    let plugins = load(vec![(path, bounded)]).await;
    let slow = ScriptedModel::replies(vec![
        Reply::Slow(std::time::Duration::from_secs(3600), "late".into()),
        Reply::Text("fine".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(slow)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout);
    assert_eq!(&*error.origin.unwrap().filter, "bounded");
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "fine"
    );
}

#[tokio::test]
async fn next_within_returns_a_timeout_the_filter_can_handle() {
    let plugins = load(vec![spec(
        "probe",
        "deadline",
        json!({ "within_ms": 50, "catch": true }),
    )])
    .await;
    let slow = ScriptedModel::replies(vec![Reply::Slow(
        std::time::Duration::from_secs(5),
        "late".into(),
    )]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(slow)
        .build()
        .unwrap();
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert!(
        response.text().starts_with("caught: "),
        "{}",
        response.text()
    );
    assert!(
        response.text().contains("did not finish within 50 ms"),
        "{}",
        response.text()
    );
}

#[tokio::test]
async fn next_within_keeps_an_inner_failure_that_came_before_the_deadline() {
    let plugins = load(vec![spec(
        "probe",
        "deadline",
        json!({ "within_ms": 5000, "catch": true }),
    )])
    .await;
    let failing = ScriptedModel::replies(vec![Reply::Fail(ChainError::new(
        ErrorKind::Auth,
        "bad key",
    ))]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(failing)
        .build()
        .unwrap();
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "caught: bad key"
    );
}

async fn instance_calls(isolation: &str) -> Vec<Value> {
    instance_calls_in(&shallot_tests::engine(), isolation).await
}

async fn instance_calls_in(engine: &shallot::Engine, isolation: &str) -> Vec<Value> {
    let config = json!({ "instance_counter": true, "hooks": ["chat"] });
    let filter = if isolation == "warm" {
        shallot_tests::warm("probe", "p", config)
    } else {
        spec("probe", "p", config)
    };
    let plugins = shallot_tests::load_in(engine, vec![filter]).await;
    let kernel = kernel(&plugins);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let context = Context::new();
        kernel.chat(ask("hi"), context.clone()).await.unwrap();
        seen.extend(
            context
                .get("instance_calls")
                .and_then(|v| v.as_array().cloned())
                .unwrap_or_default(),
        );
    }
    seen
}

#[tokio::test]
async fn invoke_isolation_gives_every_invoke_a_fresh_instance() {
    assert_eq!(
        instance_calls("invoke").await,
        [json!(1), json!(1), json!(1)],
        "nothing in instance memory survives an invoke"
    );
}

#[tokio::test]
async fn warm_isolation_reuses_instances_across_invokes() {
    assert_eq!(instance_calls("warm").await, [json!(1), json!(2), json!(3)]);
}

#[tokio::test]
async fn dropped_filters_give_back_their_room_for_idle_instances() {
    let engine = shallot::Engine::new(shallot::EngineConfig {
        instance_slots: 8,
        idle_instances: 4,
        cache_dir: Some(shallot_tests::target_dir().join("shallot-test-cache")),
        ..shallot::EngineConfig::default()
    })
    .unwrap();
    // Each set keeps an idle instance until it is dropped, as a reloaded
    // gateway's old sets do: ten sets through a budget of four.
    for _ in 0..10 {
        instance_calls_in(&engine, "warm").await;
    }
    assert_eq!(
        instance_calls_in(&engine, "warm").await,
        [json!(1), json!(2), json!(3)],
        "warm instances are still reused"
    );
}

#[tokio::test]
async fn a_warm_instance_that_trapped_is_replaced() {
    let plugins = load(vec![shallot_tests::warm(
        "misbehave",
        "bad",
        json!({ "on": "chat", "do": "trap", "when": "boom" }),
    )])
    .await;
    let kernel = kernel(&plugins);
    for _ in 0..2 {
        assert!(kernel.chat(ask("boom"), Context::new()).await.is_err());
        assert_eq!(
            kernel
                .chat(ask("hello"), Context::new())
                .await
                .unwrap()
                .text(),
            "fine"
        );
    }
}

#[tokio::test]
async fn a_tighter_memory_cap_is_enforced_per_filter() {
    let (path, mut small) = misbehave("chat", "oom");
    small.limits = Limits {
        memory_mib: 8,
        ..Limits::default()
    };
    let plugins = load(vec![(path, small)]).await;
    let error = kernel(&plugins)
        .chat(ask("boom"), Context::new())
        .await
        .unwrap_err();
    assert!(error.message.contains("memory cap of 8 MiB"), "{error}");
}
