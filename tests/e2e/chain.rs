//! Composition of the chat and tool onions (PEER-CASES B, E).

use std::sync::Arc;

use serde_json::json;
use shallot::types::{FinishReason, Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel};
use shallot_tests::{Reply, ScriptedModel, answering, ask, load, spec, strings};

fn tracer(tag: &str) -> (std::path::PathBuf, shallot::FilterSpec) {
    spec("probe", tag, json!({ "tag": tag }))
}

async fn traced_chat(filters: Vec<(std::path::PathBuf, shallot::FilterSpec)>) -> Vec<String> {
    let plugins = load(filters).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok").tracing())
        .build()
        .unwrap();
    let context = Context::new();
    kernel.chat(ask("hi"), context.clone()).await.unwrap();
    strings(&context, "trace")
}

// PEER-CASES B1
#[tokio::test]
async fn earlier_filter_is_the_outer_layer() {
    let trace = traced_chat(vec![tracer("a"), tracer("b")]).await;
    assert_eq!(
        trace,
        ["a_before", "b_before", "terminal", "b_after", "a_after"]
    );
}

// PEER-CASES B2
#[tokio::test]
async fn registration_order_is_layer_order() {
    let trace = traced_chat(vec![tracer("b"), tracer("a")]).await;
    assert_eq!(
        trace,
        ["b_before", "a_before", "terminal", "a_after", "b_after"]
    );
}

// PEER-CASES B3
#[tokio::test]
async fn empty_chain_runs_only_the_terminal() {
    assert_eq!(traced_chat(vec![]).await, ["terminal"]);
}

// PEER-CASES B4
#[tokio::test]
async fn filter_without_the_hook_is_skipped() {
    let tool_only = spec("probe", "t", json!({ "tag": "t", "hooks": ["tool"] }));
    let trace = traced_chat(vec![tracer("c"), tool_only]).await;
    assert_eq!(trace, ["c_before", "terminal", "c_after"]);
}

// PEER-CASES B6
#[tokio::test]
async fn tool_chain_wraps_the_tool() {
    let plugins = load(vec![spec(
        "probe",
        "t",
        json!({ "tag": "t", "hooks": ["tool"] }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(
            ToolSpec::new("echo", "echoes", json!({"type": "object"})),
            |args, context| async move {
                shallot_tests::push(&context, "trace", "terminal");
                Ok(args)
            },
        )
        .build()
        .unwrap();
    let context = Context::new();
    let result = kernel
        .tool("echo", json!({"x": 1}), context.clone())
        .await
        .unwrap();
    assert_eq!(result.value().unwrap(), json!({"x": 1}));
    assert_eq!(
        strings(&context, "trace"),
        ["t_before", "terminal", "t_after"]
    );
}

// PEER-CASES B7
#[tokio::test]
async fn terminal_error_is_returned_as_an_error() {
    let plugins = load(vec![tracer("a")]).await;
    let boom = ChainError::new(ErrorKind::Transient, "boom");
    let model = ScriptedModel::replies(vec![Reply::Fail(boom.clone())]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error, boom.at(shallot::Origin::terminal("model")));
}

#[tokio::test]
async fn short_circuit_skips_inner_layers_but_outer_after_runs() {
    let blocker = spec("probe", "b", json!({ "tag": "b", "short_circuit": true }));
    let plugins = load(vec![tracer("a"), blocker, tracer("c")]).await;
    let model = ScriptedModel::answer("never").tracing();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let context = Context::new();
    let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
    assert_eq!(response.text(), "short:b");
    assert_eq!(
        strings(&context, "trace"),
        ["a_before", "b_before", "b_after", "a_after"]
    );
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn calling_next_several_times_retries_the_inner_layers() {
    let retry = spec("probe", "r", json!({ "tag": "r", "calls": 3 }));
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer-{n}"))).tracing();
    let plugins = load(vec![retry, tracer("i")]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let context = Context::new();
    let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
    assert_eq!(
        response.text(),
        "answer-3",
        "the outer layer keeps the last attempt"
    );
    assert_eq!(model.calls(), 3);
    let inner = ["i_before", "terminal", "i_after"];
    let expected: Vec<&str> = std::iter::once("r_before")
        .chain(inner.repeat(3))
        .chain(["r_after"])
        .collect();
    assert_eq!(strings(&context, "trace"), expected);
}

#[tokio::test]
async fn inner_failure_reaches_the_outer_filter_as_a_value() {
    let catcher = spec("probe", "catcher", json!({ "catch": true }));
    let failing = ScriptedModel::replies(vec![Reply::Fail(ChainError::new(
        ErrorKind::Transient,
        "overloaded",
    ))]);
    let plugins = load(vec![catcher]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(failing)
        .build()
        .unwrap();
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(response.text(), "caught: overloaded");
    assert_eq!(response.finish_reason, FinishReason::Error);
}

#[tokio::test]
async fn an_error_passed_on_keeps_its_origin() {
    let plugins = load(vec![
        tracer("outer"),
        spec("misbehave", "bad", json!({ "on": "chat", "do": "error" })),
    ])
    .await;
    let kernel = answering(&plugins, "ok");
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient);
    assert_eq!(
        &*error.origin.expect("attributed").filter,
        "bad",
        "the outer filter only passed it on"
    );
}

#[tokio::test]
async fn an_error_built_to_look_like_the_inner_one_is_the_filters_own() {
    let plugins = load(vec![
        spec("misbehave", "mimic", json!({ "on": "chat", "do": "mimic" })),
        spec("misbehave", "bad", json!({ "on": "chat", "do": "error" })),
    ])
    .await;
    let kernel = answering(&plugins, "ok");
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert!(
        error.message.ends_with("misbehave: error in chat"),
        "{}",
        error.message
    );
    assert_eq!(
        &*error.origin.expect("attributed").filter,
        "mimic",
        "same kind and message, but built by the outer filter"
    );
}

#[tokio::test]
async fn a_turn_error_built_to_look_like_the_inner_one_is_the_filters_own() {
    // Armed on chat, the outer filter hands the turn's failure back as it is.
    for (armed, blamed) in [("chat", "bad"), ("turn", "outer")] {
        let plugins = load(vec![
            spec("misbehave", "outer", json!({ "on": armed, "do": "mimic" })),
            spec("misbehave", "bad", json!({ "on": "turn", "do": "error" })),
        ])
        .await;
        let kernel = answering(&plugins, "ok");
        let result = kernel
            .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
            .await;
        let TurnResult::Error(error) = result else {
            panic!("{result:?}")
        };
        assert_eq!(
            &*error.origin.expect("attributed").filter,
            blamed,
            "armed on {armed}"
        );
    }
}

#[tokio::test]
async fn the_failure_passed_on_is_the_one_it_names_not_the_last() {
    let plugins = load(vec![spec(
        "misbehave",
        "retrier",
        json!({ "on": "chat", "do": "pass-first" }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::Fail(ChainError::new(ErrorKind::Transient, "first")),
        Reply::Fail(ChainError::new(ErrorKind::Timeout, "second")),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::Transient, "first")
    );
    shallot_tests::assert_passed_on(&error, "retrier");
}

fn adder() -> (
    ToolSpec,
    impl Fn(serde_json::Value, Context) -> futures::future::Ready<Result<serde_json::Value, ChainError>>,
) {
    let spec = ToolSpec::new(
        "add",
        "adds a and b",
        json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
    );
    (spec, |args: serde_json::Value, _| {
        futures::future::ready(Ok(json!(
            args["a"].as_i64().unwrap() + args["b"].as_i64().unwrap()
        )))
    })
}

// PEER-CASES E2
#[tokio::test]
async fn tool_runs_and_an_unknown_tool_is_not_found_before_any_filter() {
    let plugins = load(vec![tracer("t")]).await;
    let (add, handler) = adder();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(add, handler)
        .build()
        .unwrap();
    assert_eq!(
        kernel
            .tool("add", json!({"a": 7, "b": 8}), Context::new())
            .await
            .unwrap()
            .output,
        "15"
    );
    let context = Context::new();
    let error = kernel
        .tool("nonexistent", json!({}), context.clone())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::NotFound);
    assert!(error.message.contains("nonexistent"));
    assert!(strings(&context, "trace").is_empty(), "no filter ran");
}

// PEER-CASES E3
#[tokio::test]
async fn a_tool_reads_the_shared_context() {
    let kernel = Kernel::builder()
        .tool(
            ToolSpec::new("whoami", "", json!({"type": "object"})),
            |_, context: Context| async move { Ok(context.get("name").unwrap_or_default()) },
        )
        .build()
        .unwrap();
    let result = kernel
        .tool("whoami", json!({}), Context::new().with("name", "Alice"))
        .await
        .unwrap();
    assert_eq!(result.output, "\"Alice\"");
}

/// `add(7, 8)` through one probe filter configured with `config`.
async fn add_through(config: serde_json::Value) -> String {
    let plugins = load(vec![spec("probe", "doubler", config)]).await;
    let (add, handler) = adder();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(add, handler)
        .build()
        .unwrap();
    let result = kernel
        .tool("add", json!({"a": 7, "b": 8}), Context::new())
        .await;
    result.unwrap().output
}

// PEER-CASES E4
#[tokio::test]
async fn before_step_rewrites_the_arguments() {
    assert_eq!(add_through(json!({ "double_args": true })).await, "30");
}

// PEER-CASES E5
#[tokio::test]
async fn after_step_rewrites_the_result() {
    assert_eq!(add_through(json!({ "double_result": true })).await, "30");
}

#[tokio::test]
async fn a_filter_changes_the_request_the_model_sees() {
    let plugins = load(vec![spec("probe", "rag", json!({ "system": "CONTEXT" }))]).await;
    let model = ScriptedModel::answer("ok");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    kernel.chat(ask("go"), Context::new()).await.unwrap();
    let seen = &model.requests()[0].messages;
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].text(), "CONTEXT");
    assert_eq!(seen[1].text(), "go");
}

/// A native filter that implements around-tool and lists no hooks.
struct Unlisted;

#[async_trait::async_trait]
impl shallot::Filter for Unlisted {
    fn name(&self) -> &str {
        "unlisted"
    }

    async fn around_tool(
        &self,
        request: shallot::types::ToolRequest,
        next: shallot::Next<shallot::Tool>,
    ) -> Result<shallot::types::ToolResponse, ChainError> {
        next.context().set("unlisted", true);
        next.call(request).await
    }
}

#[tokio::test]
async fn a_native_filter_that_lists_no_hooks_still_runs_what_it_implements() {
    let kernel = Kernel::builder()
        .filter(Unlisted)
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap();
    let context = Context::new();
    kernel
        .tool("echo", json!({ "x": 1 }), context.clone())
        .await
        .unwrap();
    assert_eq!(context.get("unlisted"), Some(json!(true)));
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "You said: hi",
        "the hooks it does not implement pass through"
    );
}

/// A native filter with its own FCtx seed that records the FCtx it is
/// first given.
struct Seeded {
    seed: &'static str,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl shallot::Filter for Seeded {
    fn name(&self) -> &str {
        "a"
    }

    fn init_fctx(&self) -> shallot::Fctx {
        self.seed.into()
    }

    async fn around_chat(
        &self,
        request: shallot::types::ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        let fctx = next.fctx().expect("inside a filter");
        self.seen.lock().unwrap().push(fctx.to_string());
        next.call(request).await
    }
}

// PEER-CASES A1, A2
/// A1/A2: a filter's private context starts as an empty map unless the
/// filter gives its own seed.
#[tokio::test]
async fn a_filters_state_starts_empty_or_from_its_seed() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kernel = Kernel::builder()
        .filter(crate::tools::Remembers(seen.clone()))
        .model(ScriptedModel::answer("ok"))
        .build()
        .unwrap();
    kernel.chat(ask("hi"), Context::new()).await.unwrap();
    let seeded = Seeded {
        seed: r#"{"seed":42}"#,
        seen: seen.clone(),
    };
    let kernel = Kernel::builder()
        .filter(seeded)
        .model(ScriptedModel::answer("ok"))
        .build()
        .unwrap();
    kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), ["{}", r#"{"seed":42}"#]);
}
