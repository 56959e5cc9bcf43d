//! `trace` as an audit: tool arguments and results on request, with fields
//! redacted by name and by pattern, and a line for every turn, a cancelled
//! one included (its deadline passed, the client went away, the embedder
//! cancelled it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shallot::types::{Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{
    CANCELLED, Cancel, ChainError, Context, ErrorKind, Gateway, GatewayConfig, InvokeOptions,
    Kernel, Route, RouteMode,
};
use shallot_tests::{Reply, ScriptedModel, granted, lines, load, spec, trace_file, trace_grant};
use tokio::sync::Notify;

use crate::gateway::Served;

fn go(text: &str) -> TurnRequest {
    TurnRequest::new(vec![Message::user(text)])
}

/// `trace`, configured with `config`, writing to `path`.
async fn tracing(path: &std::path::Path, config: Value) -> shallot::FilterSet {
    load(vec![granted(
        spec("trace", "trace", config),
        trace_grant(path),
    )])
    .await
}

/// The trace lines of `path` once one is a `turn` line (at most a minute,
/// then the test fails): what a cancelled request leaves, seen from
/// outside.
async fn turn_line(path: &std::path::Path) -> (Vec<Value>, Value) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let events = lines(path);
        if let Some(turn) = events.iter().find(|e| e["event"] == "turn").cloned() {
            return (events, turn);
        }
        assert!(Instant::now() < deadline, "no turn line: {events:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn trace_records_arguments_and_results_only_when_asked_with_fields_and_patterns_redacted() {
    let model = || {
        ScriptedModel::replies(vec![
            Reply::call(
                "login",
                json!({ "user": "ada", "Password": "hunter2", "note": "token sk-abc123 inside",
                        "nested": [{ "api_key": "k-1" }] }),
            ),
            Reply::Text("in".into()),
        ])
    };
    let login = ToolSpec::new("login", "", json!({ "type": "object" }));
    for (config, expect) in [
        (Value::Null, None),
        (
            json!({ "arguments": true, "results": true, "redact": ["password", "api_key"],
                    "redact_patterns": ["sk-[a-z0-9]+"] }),
            Some(()),
        ),
    ] {
        let path = trace_file(&format!("audit-{}", expect.is_some()));
        let plugins = tracing(&path, config).await;
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model())
            .tool(login.clone(), |_: Value, _| async {
                Ok(json!({ "session": "s-9", "secret": "sk-zzz999" }))
            })
            .build()
            .unwrap();
        let TurnResult::Done(done) = kernel.turn(go("log in"), Context::new()).await else {
            panic!("the turn ends");
        };
        assert_eq!(done.response.text(), "in");
        let events = lines(&path);
        let tool = events.iter().find(|e| e["event"] == "tool").unwrap();
        match expect {
            None => {
                assert!(
                    tool.get("arguments").is_none() && tool.get("output").is_none(),
                    "sizes only by default: {tool}"
                );
                assert!(tool["arguments_bytes"].as_u64().unwrap() > 0);
            }
            Some(()) => {
                assert_eq!(
                    tool["arguments"],
                    json!({ "user": "ada", "Password": "[redacted]",
                            "note": "token [redacted] inside",
                            "nested": [{ "api_key": "[redacted]" }] })
                );
                assert_eq!(
                    tool["output"],
                    json!({ "session": "s-9", "secret": "[redacted]" })
                );
            }
        }
    }
}

#[tokio::test]
async fn trace_refuses_a_redaction_pattern_it_cannot_use() {
    for (pattern, says) in [
        ("(", "redact_patterns[0]"),
        ("x*", "matches the empty string"),
    ] {
        let config = json!({ "redact_patterns": [pattern] });
        let error = crate::loading::refused("trace", "trace", config).await;
        assert!(error.to_string().contains(says), "{pattern}: {error}");
    }
}

/// A kernel whose filters are `trace` (to `path`) over a model that waits
/// for ever once it is asked (saying so on `asked`), as a model that
/// never answers.
async fn stuck(path: &std::path::Path, asked: Arc<Notify>) -> Kernel {
    let plugins = tracing(path, Value::Null).await;
    let model = ScriptedModel::new(move |_, _| {
        asked.notify_one();
        Reply::Slow(Duration::from_secs(3600), "never".into())
    });
    Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_turn_the_embedder_cancels_ends_with_its_reason_and_leaves_a_cancelled_line() {
    let path = trace_file("cancel-embedder");
    let asked = Arc::new(Notify::new());
    let kernel = stuck(&path, asked.clone()).await;
    let cancel = Cancel::new();
    let context = Context::new();
    let options = InvokeOptions::from(context.clone()).cancel_on(cancel.clone());
    let turn = tokio::spawn(async move { kernel.turn(go("hi"), options).await });
    asked.notified().await;
    cancel.cancel(ChainError::new(ErrorKind::Timeout, "the user gave up"));
    let TurnResult::Error(error) = turn.await.unwrap() else {
        panic!("a cancelled turn fails");
    };
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::Timeout, "the user gave up")
    );
    assert_eq!(context.get(CANCELLED), Some(json!("the user gave up")));
    let events = lines(&path);
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["chat", "turn"],
        "the model call's line, then the turn's"
    );
    assert_eq!(events[0]["error"]["kind"], "timeout");
    assert_eq!(
        (&events[1]["outcome"], &events[1]["reason"]),
        (&json!("cancelled"), &json!("the user gave up"))
    );
}

#[tokio::test]
async fn a_tool_that_never_ends_is_cancelled_and_the_turn_ends_without_asking_the_model_again() {
    let path = trace_file("cancel-tool");
    let plugins = tracing(&path, Value::Null).await;
    let model = ScriptedModel::replies(vec![
        Reply::call("wait", json!({})),
        Reply::Text("no".into()),
    ]);
    let reached = Arc::new(Notify::new());
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .tool(ToolSpec::new("wait", "", json!({ "type": "object" })), {
            let reached = reached.clone();
            move |_: Value, _| {
                let reached = reached.clone();
                async move {
                    reached.notify_one();
                    std::future::pending::<Result<Value, ChainError>>().await
                }
            }
        })
        .build()
        .unwrap();
    let cancel = Cancel::new();
    let options = InvokeOptions::from(Context::new()).cancel_on(cancel.clone());
    let turn = tokio::spawn(async move { kernel.turn(go("wait"), options).await });
    reached.notified().await;
    cancel.cancel(ChainError::new(ErrorKind::Transient, "shutting down"));
    assert!(matches!(turn.await.unwrap(), TurnResult::Error(e) if e.message == "shutting down"));
    assert_eq!(model.requests().len(), 1, "the model is not asked again");
    let kinds: Vec<String> = lines(&path)
        .iter()
        .map(|e| {
            format!(
                "{}:{}",
                e["event"].as_str().unwrap(),
                e["outcome"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(kinds, ["chat:", "tool:", "chat:", "turn:cancelled"]);
}

/// A gateway with one agent route, `agent`, over `kernel`.
async fn agent_gateway(kernel: Kernel, config: GatewayConfig) -> Served {
    let route = Route {
        model: "agent".into(),
        kernel,
        mode: RouteMode::Agent,
        store: None,
    };
    Served::gateway(Gateway::new(vec![route], config)).await
}

fn ask_agent() -> Value {
    json!({ "model": "agent", "messages": [{ "role": "user", "content": "hi" }] })
}

#[tokio::test]
async fn a_gateway_turn_past_its_deadline_is_answered_504_after_its_cancelled_line() {
    let path = trace_file("cancel-deadline");
    let kernel = stuck(&path, Arc::new(Notify::new())).await;
    // Time enough for the turn to reach its filters on a busy machine; the
    // turn itself never ends.
    let config = GatewayConfig {
        request_timeout: Duration::from_secs(2),
        ..GatewayConfig::default()
    };
    let served = agent_gateway(kernel, config).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .json(&ask_agent())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 504);
    // The answer waits for the turn to end, so its line is there already.
    let turn = lines(&path)
        .into_iter()
        .find(|e| e["event"] == "turn")
        .expect("a turn line");
    assert_eq!(
        (&turn["outcome"], &turn["reason"]),
        (
            &json!("cancelled"),
            &json!("the request did not finish within 2000 ms")
        )
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_gateway_turn_whose_client_goes_away_leaves_a_cancelled_line_in_both_modes() {
    for stream in [false, true] {
        let path = trace_file(&format!("cancel-gone-{stream}"));
        let asked = Arc::new(Notify::new());
        let kernel = stuck(&path, asked.clone()).await;
        let served = agent_gateway(kernel, GatewayConfig::default()).await;
        let mut request = ask_agent();
        request["stream"] = json!(stream);
        let url = format!("{}/v1/chat/completions", served.base);
        let client =
            tokio::spawn(
                async move { reqwest::Client::new().post(url).json(&request).send().await },
            );
        asked.notified().await;
        client.abort();
        let (_, turn) = turn_line(&path).await;
        assert_eq!(
            (&turn["outcome"], &turn["reason"]),
            (&json!("cancelled"), &json!("the client went away")),
            "stream: {stream}"
        );
        served.stop().await.unwrap();
    }
}

#[tokio::test]
async fn a_result_too_long_for_a_trace_line_is_cut_and_its_line_kept() {
    let path = trace_file("audit-long");
    let plugins = tracing(
        &path,
        json!({ "arguments": true, "results": true, "redact": ["secret", "a_secret"] }),
    )
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("dump", json!({ "secret": "s3", "what": "all" })),
        Reply::Text("ok".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(
            ToolSpec::new("dump", "", json!({ "type": "object" })),
            |_: Value, _| async {
                Ok(json!({ "a_secret": "hidden", "rows": "\u{1}".repeat(100 << 10) }))
            },
        )
        .build()
        .unwrap();
    let TurnResult::Done(_) = kernel.turn(go("dump"), Context::new()).await else {
        panic!("the turn ends");
    };
    let events = lines(&path);
    let tool = events
        .iter()
        .find(|e| e["event"] == "tool")
        .expect("the tool's line is kept");
    assert_eq!(tool["output_truncated"], true);
    let shown = tool["output"].as_str().unwrap();
    assert!(shown.len() <= 16 << 10, "{}", shown.len());
    assert!(
        shown.starts_with(r#"{"a_secret":"[redacted]","rows":"\u0001"#),
        "redacted before it is cut: {}",
        &shown[..80]
    );
    assert!(!shown.contains("hidden"));
    assert_eq!(
        tool["arguments"],
        json!({ "secret": "[redacted]", "what": "all" })
    );
    assert!(tool.get("arguments_truncated").is_none());
}
