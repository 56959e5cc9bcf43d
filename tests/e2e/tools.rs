//! Tool execution as the tool terminal runs it (PEER-CASES N): retries of
//! transient failures, timeouts, panicking handlers contained, and a batch
//! whose around-tool filter traps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::{Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel, KernelBuilder};
use shallot_tests::{Reply, ScriptedModel, load, spec};

/// A kernel with the tool `flaky`, whose handler fails with `fail` on its
/// first `failures` calls, then answers "done"; and the call counter.
fn flaky(spec: ToolSpec, failures: u32, fail: ErrorKind) -> (Kernel, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let kernel = Kernel::builder()
        .model(ScriptedModel::answer("unused"))
        .tool(spec, move |_: Value, _| {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n <= failures {
                    Err(ChainError::new(fail, format!("failure {n}")))
                } else {
                    Ok(json!("done"))
                }
            }
        })
        .build()
        .unwrap();
    (kernel, calls)
}

fn tool(name: &str) -> ToolSpec {
    ToolSpec::new(name, "a test tool", json!({"type": "object"}))
}

// PEER-CASES N1
#[tokio::test]
async fn transient_failures_are_retried_until_the_call_succeeds() {
    let (kernel, calls) = flaky(tool("flaky").retries(3), 2, ErrorKind::Timeout);
    let response = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(response.value().unwrap(), json!("done"));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

// PEER-CASES N2
#[tokio::test]
async fn a_semantic_failure_is_not_retried() {
    let (kernel, calls) = flaky(tool("flaky").retries(3), 5, ErrorKind::InvalidRequest);
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// PEER-CASES N3
#[tokio::test]
async fn retries_that_run_out_return_the_last_failure() {
    let (kernel, calls) = flaky(tool("flaky").retries(2), 99, ErrorKind::Transient);
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.message, "failure 3");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

// PEER-CASES N4
#[tokio::test]
async fn without_retries_a_tool_is_called_once() {
    let (kernel, calls) = flaky(tool("flaky"), 1, ErrorKind::Transient);
    kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

fn sleeper(spec: ToolSpec, sleep: Duration) -> (Kernel, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let kernel = Kernel::builder()
        .model(ScriptedModel::answer("unused"))
        .tool(spec, move |_: Value, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(sleep).await;
                Ok(json!("slow-done"))
            }
        })
        .build()
        .unwrap();
    (kernel, calls)
}

// PEER-CASES N6
#[tokio::test]
async fn a_tool_past_its_timeout_fails_with_a_timeout_error() {
    let (kernel, _) = sleeper(
        tool("slow").timeout(Duration::from_millis(100)),
        Duration::from_secs(3600),
    );
    let error = kernel
        .tool("slow", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout);
    assert_eq!(error.message, "tool 'slow' did not finish within 100 ms");
}

// PEER-CASES N8
#[tokio::test]
async fn a_tool_within_its_timeout_or_without_one_answers() {
    let (kernel, _) = sleeper(
        tool("slow").timeout(Duration::from_secs(60)),
        Duration::from_millis(20),
    );
    let response = kernel
        .tool("slow", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(response.value().unwrap(), json!("slow-done"));
    let (kernel, _) = sleeper(tool("slow"), Duration::from_millis(20));
    assert!(kernel.tool("slow", json!({}), Context::new()).await.is_ok());
}

// PEER-CASES N10
#[tokio::test]
async fn a_timeout_is_retried_like_any_transient_failure() {
    let spec = tool("slow").timeout(Duration::from_millis(50)).retries(2);
    let (kernel, calls) = sleeper(spec, Duration::from_secs(3600));
    let error = kernel
        .tool("slow", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

fn panicking() -> Kernel {
    Kernel::builder()
        .model(ScriptedModel::replies(vec![
            Reply::Calls(vec![
                ("boom".into(), json!({"n": 1})),
                ("boom".into(), json!({"n": 2})),
                ("boom".into(), json!({"n": 3})),
            ]),
            Reply::Text("recovered".into()),
        ]))
        .tool(tool("boom"), |args: Value, _| async move {
            if args["n"].is_number() {
                panic!("badthing {}", args["n"]);
            }
            Ok(json!("fine"))
        })
        .build()
        .unwrap()
}

// PEER-CASES N11
#[tokio::test]
async fn a_panicking_handler_fails_its_call_and_the_caller_survives() {
    let kernel = panicking();
    let error = kernel
        .tool("boom", json!({"n": 0}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Internal);
    assert_eq!(error.message, "tool 'boom' panicked: badthing 0");
    let again = kernel
        .tool("boom", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(again.value().unwrap(), json!("fine"));
}

// PEER-CASES N33
#[tokio::test]
async fn a_batch_of_panicking_calls_gives_an_error_record_each_in_order() {
    let result = panicking()
        .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
        .await;
    let TurnResult::Done(done) = result else {
        panic!("expected a done turn, got {result:?}")
    };
    assert_eq!(
        done.response.text(),
        "recovered",
        "the model got the errors and answered"
    );
    let records: Vec<(String, String)> = done
        .tool_calls
        .iter()
        .map(|r| {
            (
                r.call.arguments.to_string(),
                r.error.as_ref().unwrap().message.clone(),
            )
        })
        .collect();
    assert_eq!(
        records,
        [1, 2, 3].map(|n| (
            format!("{{\"n\":{n}}}"),
            format!("tool 'boom' panicked: badthing {n}")
        ))
    );
}

/// N35: a turn whose model asks for two calls, through `filters`; each
/// call fails with a plugin fault from `filter`, and the turn carries on.
/// The kernel and the failures.
async fn batch_failed_by(filters: KernelBuilder, filter: &str) -> (Kernel, Vec<ChainError>) {
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("echo".into(), json!({"text": "a"})),
            ("echo".into(), json!({"text": "b"})),
        ]),
        Reply::Text("carried on".into()),
    ]);
    let kernel = filters.model(model).builtin_tools().build().unwrap();
    let result = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
        .await;
    let TurnResult::Done(done) = result else {
        panic!("expected a done turn, got {result:?}")
    };
    assert_eq!(done.response.text(), "carried on");
    assert_eq!(done.tool_calls.len(), 2);
    let errors: Vec<ChainError> = done
        .tool_calls
        .into_iter()
        .map(|record| record.error.expect("each call failed"))
        .collect();
    for error in &errors {
        assert_eq!(error.kind, ErrorKind::PluginFault);
        assert_eq!(&*error.origin.as_ref().unwrap().filter, filter);
    }
    (kernel, errors)
}

// PEER-CASES N35
#[tokio::test]
async fn a_trapping_around_tool_filter_fails_each_call_of_the_batch_not_the_turn() {
    let plugins = load(vec![spec(
        "misbehave",
        "bad",
        json!({ "on": "tool", "do": "trap" }),
    )])
    .await;
    let (kernel, _) = batch_failed_by(Kernel::builder().plugins(&plugins), "bad").await;
    let next_turn = kernel
        .turn(
            TurnRequest::new(vec![Message::user("again")]),
            Context::new(),
        )
        .await;
    assert!(
        matches!(next_turn, TurnResult::Done(_)),
        "a fresh instance serves the next turn"
    );
}

/// A native filter that panics around every tool call.
struct Panicky;

#[async_trait::async_trait]
impl shallot::Filter for Panicky {
    fn name(&self) -> &str {
        "panicky"
    }

    async fn around_tool(
        &self,
        request: shallot::types::ToolRequest,
        _: shallot::Next<shallot::Tool>,
    ) -> Result<shallot::types::ToolResponse, ChainError> {
        panic!("lost {}", request.arguments)
    }
}

// PEER-CASES N35
/// N35 for a native filter: its panic fails each call of the batch with a
/// typed error naming it, and the turn (and the host) carry on.
#[tokio::test]
async fn a_panicking_native_around_tool_filter_fails_each_call_not_the_turn() {
    let (_, errors) = batch_failed_by(Kernel::builder().filter(Panicky), "panicky").await;
    for error in errors {
        assert!(
            error.message.contains("panicked: lost {\"text\""),
            "{error}"
        );
    }
}

/// A native filter that keeps each tool call's arguments in its FCtx and
/// records the FCtx each model call starts from.
pub(crate) struct Remembers(pub(crate) Arc<std::sync::Mutex<Vec<String>>>);

#[async_trait::async_trait]
impl shallot::Filter for Remembers {
    fn name(&self) -> &str {
        "remembers"
    }

    async fn around_chat(
        &self,
        request: shallot::types::ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        self.0
            .lock()
            .unwrap()
            .push(next.fctx().unwrap().to_string());
        next.call(request).await
    }

    async fn around_tool(
        &self,
        request: shallot::types::ToolRequest,
        next: shallot::Next<shallot::Tool>,
    ) -> Result<shallot::types::ToolResponse, ChainError> {
        next.set_fctx(request.arguments.to_string());
        next.call(request).await
    }
}

/// A native filter's FCtx writes in a concurrent batch fold like a
/// guest's: the last writer by call index wins (their charges were once
/// given back without having been taken, and the ledger underflowed).
#[tokio::test]
async fn native_fctx_writes_in_a_concurrent_batch_fold_by_call_index() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("echo".into(), json!({"n": 1})),
            ("echo".into(), json!({"n": 2})),
        ]),
        Reply::Text("done".into()),
    ]);
    let kernel = Kernel::builder()
        .filter(Remembers(seen.clone()))
        .model(model)
        .builtin_tools()
        .build()
        .unwrap();
    let result = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
        .await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    assert_eq!(*seen.lock().unwrap(), ["{}", r#"{"n":2}"#]);
}

/// A turn whose first round calls `write` (k = "one", slow), `read`,
/// `write` (k = "two", fast) and `fail_write` (writes `gone`, then fails),
/// and whose second round calls `read`. What the two reads saw, and the
/// context after the turn.
async fn tool_writes(config: shallot::LoopConfig) -> (Vec<Option<Value>>, Context) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let read = seen.clone();
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("write".into(), json!({"k": "one", "ms": 50})),
            ("read".into(), json!({})),
            ("write".into(), json!({"k": "two", "ms": 0})),
            ("fail_write".into(), json!({})),
        ]),
        Reply::Calls(vec![("read".into(), json!({}))]),
        Reply::Text("done".into()),
    ]);
    let kernel = Kernel::builder()
        .model(model)
        .turn_terminal(shallot::ToolLoop::new(config, shallot::NoHistory))
        .tool(tool("write"), |args: Value, context: Context| async move {
            tokio::time::sleep(Duration::from_millis(args["ms"].as_u64().unwrap())).await;
            context.set("k", args["k"].clone());
            Ok(json!("written"))
        })
        .tool(tool("read"), move |_, context: Context| {
            read.lock().unwrap().push(context.get("k"));
            async { Ok(json!("read")) }
        })
        .tool(tool("fail_write"), |_, context: Context| async move {
            context.set("gone", true);
            Err(ChainError::new(
                ErrorKind::InvalidRequest,
                "failed after writing",
            ))
        })
        .build()
        .unwrap();
    let (result, context) = shallot_tests::turn_go(&kernel).await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    let seen = seen.lock().unwrap().clone();
    (seen, context)
}

// PEER-CASES O33, O34, O35, O40
/// O33–O35 and O40: tools' writes to the shared context are folded when
/// their batch ends: a reader in the same batch sees none of them (O33),
/// the last writer by call index wins, not the last to finish (O34), a
/// failed tool's writes are dropped (O35), and the next round sees the
/// fold (O40) — concurrent or one after another (O30, O32).
#[tokio::test]
async fn tools_writes_fold_by_call_index_when_their_batch_ends() {
    for parallel_tools in [true, false] {
        let config = shallot::LoopConfig {
            parallel_tools,
            ..shallot::LoopConfig::default()
        };
        let (seen, context) = tool_writes(config).await;
        assert_eq!(
            seen,
            [None, Some(json!("two"))],
            "parallel: {parallel_tools}"
        );
        assert_eq!(context.get("k"), Some(json!("two")));
        assert_eq!(context.get("gone"), None);
    }
}
